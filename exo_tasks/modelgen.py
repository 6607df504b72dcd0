"""Deterministic random-weight Llama models, with an ASCII character tokenizer or a BPE one.

No model can be downloaded here, so the stack and its tests make their own: small Llamas that
`mlx_lm.load` reads. `tiny` has a character tokenizer over ASCII, the smallest model there is;
`chat` and `bench` have a byte-level BPE tokenizer with a ChatML template (exo_tasks.bpe), so
they take the path real models take. A random model with byte tokens would emit invalid UTF-8,
so the output head never favours a token that is not whole characters on its own (those stay in
the vocabulary: prompts use them).
"""

from __future__ import annotations

import json
import math
import string
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # imported where a model is made: the worker imports this module to check
    import numpy as np

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
    tokenizer: Literal["chars", "bpe"] = "chars"
    # How much the EOS row of the head is scaled: small, greedy text runs to max_tokens; at
    # 2 a chat answer ends by itself after some tens of tokens.
    eos_scale: float = 0.1


PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(64, 2, 128, 4, 2, "float32"),
    "chat": ModelPreset(64, 2, 128, 4, 2, "float32", "bpe", 2.0),
    "bench": ModelPreset(512, 8, 1536, 8, 4, "float16", "bpe"),
}
MAX_LENGTH = 4096
# Names the preset in config.json (mlx-lm ignores it), so a model of an older preset of the same
# name (the `bench` made before it had a BPE tokenizer) is made again.
PRESET_KEY = "exo_preset"


def _preset(name: str) -> ModelPreset:
    """Look up a preset, naming the valid ones if `name` is not one."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; valid presets: {sorted(PRESETS)}") from None


@dataclass(frozen=True)
class VocabInfo:
    """What the weights need to know of a tokenizer."""

    size: int
    eos_id: int
    quiet: list[int]  # special tokens greedy text should not produce (scaled like EOS)
    never: list[int]  # tokens that are not whole characters: their head rows are zero


def model_config(preset: str, vocab: VocabInfo) -> dict[str, Any]:
    """The Hugging Face style `config.json` contents for `preset`."""
    p = _preset(preset)
    fields = asdict(p)
    dtype = fields.pop("dtype")
    del fields["tokenizer"], fields["eos_scale"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **fields,
        "head_dim": p.hidden_size // p.num_attention_heads,
        "vocab_size": vocab.size,
        "max_position_embeddings": MAX_LENGTH,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": None,
        "eos_token_id": vocab.eos_id,
        PRESET_KEY: preset,
    }


def _weights(p: ModelPreset, vocab: VocabInfo) -> dict[str, np.ndarray]:
    """Seeded random weights, named as in a Hugging Face Llama checkpoint."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    h, kv = p.hidden_size, p.num_key_value_heads * (p.hidden_size // p.num_attention_heads)

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return rng.standard_normal((out_dim, in_dim), np.float32) / math.sqrt(in_dim)

    w = {"model.embed_tokens.weight": rng.standard_normal((vocab.size, h), np.float32)}
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
    # Logits are ~N(0, 1): quiet rows scaled by 0.1 never win a greedy step, zero rows (logit
    # 0, below the maximum of thousands) neither; the EOS row by the preset's scale.
    head = linear(vocab.size, h)
    head[vocab.quiet] *= 0.1
    head[vocab.never] = 0.0
    head[vocab.eos_id] *= p.eos_scale
    w["lm_head.weight"] = head
    return {k: v.astype(p.dtype) for k, v in w.items()}


def _write_char_tokenizer(directory: Path) -> VocabInfo:
    """Write a character-level fast tokenizer that `AutoTokenizer` loads offline."""
    from tokenizers import Tokenizer, decoders, models

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
        "model_max_length": MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (directory / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    return VocabInfo(len(VOCAB), VOCAB[EOS], [VOCAB[UNK]], [])


def _write_bpe_tokenizer(directory: Path) -> VocabInfo:
    from exo_tasks import bpe

    tok = bpe.write(directory, MAX_LENGTH)
    ids = tok.get_vocab()
    quiet = [ids[t] for t in bpe.SPECIAL_TOKENS if t != bpe.IM_END]
    return VocabInfo(tok.get_vocab_size(), ids[bpe.IM_END], quiet, bpe.partial_tokens(tok))


def create_model(preset: str, directory: Path) -> Path:
    """Write the `preset` model (config, weights, tokenizer) into `directory`."""
    from safetensors.numpy import save_file

    p = _preset(preset)
    directory.mkdir(parents=True, exist_ok=True)
    write = _write_bpe_tokenizer if p.tokenizer == "bpe" else _write_char_tokenizer
    vocab = write(directory)
    save_file(_weights(p, vocab), str(directory / "model.safetensors"), {"format": "pt"})
    # Written last: `ensure_model` treats a present config.json as a complete model.
    config = model_config(preset, vocab)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def is_made(preset: str, directory: Path) -> bool:
    """Whether `directory` holds the `preset` model."""
    config = directory / "config.json"
    return config.exists() and json.loads(config.read_text()).get(PRESET_KEY) == preset


def ensure_model(preset: str, directory: Path) -> Path:
    """Create the `preset` model in `directory` unless that preset is already there."""
    if not is_made(preset, directory):
        create_model(preset, directory)
    return directory
