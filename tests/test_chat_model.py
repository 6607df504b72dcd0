"""The `chat` preset: a byte-level BPE tokenizer trained at creation, a ChatML template with
`<|im_end|>` as EOS, loaded by mlx-lm with its BPE streaming detokenizer."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mlx_lm
import pytest

from exo_tasks import bpe
from exo_tasks.modelgen import create_model

PROMPTS = [
    "hello there",
    "世界你好 今天",
    "emoji 😀🎉 party",
    "café résumé naïve",
    "e\u0301a\u0300",
]


@pytest.fixture(scope="module")
def loaded(chat_model: Path) -> tuple[Any, Any]:
    return mlx_lm.load(str(chat_model))[:2]


def test_creation_is_fast_and_deterministic(tmp_path: Path) -> None:
    started = time.monotonic()
    a = create_model("chat", tmp_path / "a")
    elapsed = time.monotonic() - started
    assert elapsed < 10, f"creating the chat model took {elapsed:.1f} s"
    b = create_model("chat", tmp_path / "b")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_mlx_lm_loads_a_bpe_tokenizer_with_chatml(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    assert type(tokenizer.detokenizer).__name__ == "BPEStreamingDetokenizer"
    assert tokenizer.eos_token == bpe.IM_END
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids(bpe.IM_END)}
    assert len(tokenizer.get_vocab()) == bpe.VOCAB_SIZE
    ids = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True,
    )
    for special in (bpe.IM_START, bpe.IM_END):  # one token each, not spelled out
        assert tokenizer.convert_tokens_to_ids(special) in ids
    rendered = tokenizer._tokenizer.decode(ids, skip_special_tokens=False)
    assert rendered == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_merges_cover_non_ascii_and_split_characters(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    for text in ("世界你好今天", "😀🎉", "résumé"):
        ids = tokenizer.encode(text)
        assert len(ids) < len(text.encode()), text  # merged, not one token per byte
        assert tokenizer.decode(ids) == text
    # Some tokens end mid-character (the detokenizer must hold them back).
    tok = tokenizer._tokenizer.backend_tokenizer
    assert len(bpe.partial_tokens(tok)) > 100


def test_greedy_text_is_varied_whole_characters(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    texts = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
        responses = list(mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=48))
        text = "".join(r.text for r in responses)
        assert "\ufffd" not in text and bpe.IM_END not in text
        assert text == mlx_lm.generate(model, tokenizer, ids, max_tokens=48)
        texts.append(text)
    joined = "".join(texts)
    assert any(ord(c) > 0x3000 for c in joined)  # CJK or emoji come out
    assert any(0x80 <= ord(c) < 0x3000 for c in joined)  # accented letters too
