"""Deterministic random-weight Llama models with an ASCII character tokenizer.

No model can be downloaded here, so the stack and its tests make their own: a tiny
Llama that `mlx_lm.load` reads, whose greedy output is varied printable ASCII.
The vocabulary is ASCII characters only: with byte tokens a random model emits
invalid UTF-8 and streamed text stalls.
"""

from __future__ import annotations

import json
import math
import string
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models

UNK = "<unk>"
EOS = "<|endoftext|>"
# One token per printable ASCII character; vertical tab, form feed and CR are left out.
CHARS = [c for c in string.printable if c not in "\x0b\x0c\r"]
VOCAB = {tok: i for i, tok in enumerate([UNK, EOS, *CHARS])}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SEED = 0


@dataclass(frozen=True)
class ModelPreset:
    """Shape and dtype of a generated Llama model."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    dtype: str  # "float32" or "float16"


PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(64, 2, 128, 4, 2, "float32"),
    "bench": ModelPreset(512, 8, 1536, 8, 4, "float16"),
}


def _preset(name: str) -> ModelPreset:
    """Look up a preset, naming the valid ones if `name` is not one."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; valid presets: {sorted(PRESETS)}") from None


def model_config(preset: str) -> dict[str, Any]:
    """The Hugging Face style `config.json` contents for `preset`."""
    p = _preset(preset)
    fields = asdict(p)
    dtype = fields.pop("dtype")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **fields,
        "head_dim": p.hidden_size // p.num_attention_heads,
        "vocab_size": len(VOCAB),
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": None,
        "eos_token_id": VOCAB[EOS],
    }


def _weights(p: ModelPreset) -> dict[str, np.ndarray]:
    """Seeded random weights, named as in a Hugging Face Llama checkpoint."""
    rng = np.random.default_rng(SEED)
    h, kv = p.hidden_size, p.num_key_value_heads * (p.hidden_size // p.num_attention_heads)

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return rng.standard_normal((out_dim, in_dim), np.float32) / math.sqrt(in_dim)

    w = {"model.embed_tokens.weight": rng.standard_normal((len(VOCAB), h), np.float32)}
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (h, h),
            "self_attn.k_proj": (kv, h),
            "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, h),
            "mlp.gate_proj": (p.intermediate_size, h),
            "mlp.up_proj": (p.intermediate_size, h),
            "mlp.down_proj": (h, p.intermediate_size),
        }
        w.update({f"{pre}{name}.weight": linear(*shape) for name, shape in shapes.items()})
        w[f"{pre}input_layernorm.weight"] = np.ones(h, np.float32)
        w[f"{pre}post_attention_layernorm.weight"] = np.ones(h, np.float32)
    w["model.norm.weight"] = np.ones(h, np.float32)
    # Logits are ~N(0, 1); the <unk>/EOS rows are scaled by 0.1 so greedy text runs long.
    head = linear(len(VOCAB), h)
    head[[VOCAB[UNK], VOCAB[EOS]]] *= 0.1
    w["lm_head.weight"] = head
    return {k: v.astype(p.dtype) for k, v in w.items()}


def _write_tokenizer(directory: Path) -> None:
    """Write a character-level fast tokenizer that `AutoTokenizer` loads offline."""
    tok = Tokenizer(models.BPE(vocab=VOCAB, merges=[], unk_token=UNK))
    # mlx-lm streams with its SPM detokenizer for this decoder: exact concatenation.
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_special_tokens([UNK, EOS])
    tok.save(str(directory / "tokenizer.json"))
    specials = {"unk_token": UNK, "eos_token": EOS}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (directory / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))


def create_model(preset: str, directory: Path) -> Path:
    """Write the `preset` model (config, weights, tokenizer) into `directory`."""
    config = model_config(preset)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(_weights(PRESETS[preset]), str(directory / "model.safetensors"), {"format": "pt"})
    _write_tokenizer(directory)
    # Written last: `ensure_model` treats a present config.json as a complete model.
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def ensure_model(preset: str, directory: Path) -> Path:
    """Create the `preset` model in `directory` unless a `config.json` is already there."""
    if not (directory / "config.json").exists():
        create_model(preset, directory)
    return directory
