"""The generated models load and generate with real MLX, and creation is deterministic."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest

from exo_tasks.bpe import IM_END, VOCAB_SIZE
from exo_tasks.modelgen import EOS, UNK, create_model, ensure_model

PRINTABLE = set(string.printable)


def test_greedy_generation_is_printable_ascii(tiny_loaded: tuple[Any, Any]) -> None:
    model, tokenizer = tiny_loaded
    for prompt in ("hello", "The quick brown fox"):
        text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=16)
        assert len(text) == 16  # no EOS within 16 greedy tokens
        assert set(text) <= PRINTABLE
        assert len(set(text)) > 3  # varied, not one repeated character


def test_stream_generate_yields_text(tiny_loaded: tuple[Any, Any]) -> None:
    model, tokenizer = tiny_loaded
    responses = list(mlx_lm.stream_generate(model, tokenizer, "hello", max_tokens=8))
    text = "".join(r.text for r in responses)
    assert text and set(text) <= PRINTABLE
    assert text == tokenizer.decode([r.token for r in responses])


def test_round_trip_unk_and_eos(tiny_loaded: tuple[Any, Any]) -> None:
    _, tokenizer = tiny_loaded
    s = " two  spaces\nnew line\ttab ~!{}<|x|> "
    ids = tokenizer.encode(s)
    assert len(ids) == len(s)  # one token per character, no BOS
    assert tokenizer.decode(ids) == s
    assert tokenizer.encode("a\u00e9b")[1] == tokenizer.unk_token_id
    assert tokenizer.unk_token == UNK
    assert tokenizer.eos_token == EOS
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids(EOS)
    assert tokenizer.eos_token_ids == {tokenizer.eos_token_id}
    config = json.loads((Path(tokenizer.name_or_path) / "config.json").read_text())
    assert config["eos_token_id"] == tokenizer.eos_token_id


def test_streaming_detokenizer_matches_decode(tiny_loaded: tuple[Any, Any]) -> None:
    _, tokenizer = tiny_loaded
    ids = [*tokenizer.encode("  lead\n\ttab  trail "), tokenizer.eos_token_id]
    detokenizer = tokenizer.detokenizer
    streamed = ""
    for token in ids:
        detokenizer.add_token(token)
        streamed += detokenizer.last_segment
    detokenizer.finalize()
    streamed += detokenizer.last_segment
    assert streamed == detokenizer.text == tokenizer.decode(ids)


def test_chat_template_renders(tiny_loaded: tuple[Any, Any]) -> None:
    _, tokenizer = tiny_loaded
    messages = [{"role": "user", "content": "hi"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert tokenizer.decode(ids) == "<|user|>\nhi\n<|assistant|>\n"


def test_creation_is_deterministic(tmp_path: Path) -> None:
    a, b = create_model("tiny", tmp_path / "a"), create_model("tiny", tmp_path / "b")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_ensure_model_does_not_rewrite(tiny_model: Path) -> None:
    weights = tiny_model / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert ensure_model("tiny", tiny_model) == tiny_model
    assert weights.stat().st_mtime_ns == before


def test_ensure_model_makes_again_a_model_of_another_preset(tmp_path: Path) -> None:
    # A `bench` made before bench had a BPE tokenizer: ensure_model writes the preset again.
    directory = create_model("tiny", tmp_path / "bench")
    assert ensure_model("bench", directory) == directory
    config = json.loads((directory / "config.json").read_text())
    assert config["exo_preset"] == "bench" and config["vocab_size"] == VOCAB_SIZE


def test_ensure_model_creates_when_missing(tmp_path: Path) -> None:
    directory = ensure_model("tiny", tmp_path / "new" / "tiny")
    assert (directory / "config.json").exists() and (directory / "model.safetensors").exists()


def test_bench_preset_creates_and_loads(tmp_path: Path) -> None:
    directory = create_model("bench", tmp_path / "bench")
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "llama" and config["torch_dtype"] == "float16"
    shape = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads")
    assert [config[k] for k in shape] == [512, 8, 1536, 8]
    assert config["num_key_value_heads"] == 4
    model, tokenizer = mlx_lm.load(str(directory))[:2]
    assert model.model.embed_tokens.weight.dtype == mx.float16
    assert len(model.layers) == 8
    assert type(tokenizer.detokenizer).__name__ == "BPEStreamingDetokenizer"
    assert tokenizer.eos_token == IM_END and config["vocab_size"] == VOCAB_SIZE


def test_unknown_preset_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"valid presets.*bench.*tiny"):
        create_model("huge", tmp_path / "huge")
    assert not (tmp_path / "huge").exists()
