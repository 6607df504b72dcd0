"""A byte-level BPE tokenizer with a ChatML template, trained offline in about a second.

The `chat` and `bench` presets use it so that tests and benchmarks take the path real models
take: byte-level BPE whose merges split CJK, emoji and accented text into tokens that can end
mid-character, special tokens in a Jinja chat template, an end-of-turn token as EOS. It is
trained with the `tokenizers` package on a corpus generated here from a fixed seed (nothing to
download), so the same tokenizer comes out on every machine.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # the end of a turn: the model's EOS
PAD = "<|endoftext|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]
VOCAB_SIZE = 4096
CHAT_TEMPLATE = (
    "{% for m in messages %}" + IM_START + "{{ m['role'] }}\n{{ m['content'] }}" + IM_END + "\n"
    "{% endfor %}{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}"
)
SEED = 0
_SYLLABLE_TEXT = "ka ri to ne mu sa lo vi de pa zu the an ing er on st ou qu ph"
_SYLLABLES = _SYLLABLE_TEXT.split()
_ACCENTED = "àáâäãåæçèéêëìíîïñòóôöõøùúûüýÿœßÀÉÎÑÖØÜ"
_ACCENTED_TEXT = "café résumé naïve über señor façade déjà vu crème brûlée Ångström Öl"
_ACCENTED_WORDS = _ACCENTED_TEXT.split()
_COMBINING = ["\u0301", "\u0300", "\u0302", "\u0308", "\u0303", "\u0327"]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))


def _sentence(rng: random.Random) -> str:
    """One line mixing ASCII words, accented and combining letters, CJK and emoji."""
    parts: list[str] = []
    for _ in range(rng.randint(6, 14)):
        kind = rng.random()
        if kind < 0.55:
            parts.append(_word(rng).capitalize() if rng.random() < 0.1 else _word(rng))
        elif kind < 0.62:
            parts.append(rng.choice(_ACCENTED_WORDS))
        elif kind < 0.7:
            parts.append(_word(rng) + rng.choice(_ACCENTED) + _word(rng))
        elif kind < 0.78:
            parts.append(_word(rng) + "e" + rng.choice(_COMBINING))
        elif kind < 0.92:  # common CJK ideographs, a few per run
            parts.append(
                "".join(chr(0x4E00 + rng.randrange(600)) for _ in range(rng.randint(2, 5)))
            )
        else:  # emoticons and pictographs
            parts.append(chr(0x1F600 + rng.randrange(80)) + chr(0x1F300 + rng.randrange(120)))
    return " ".join(parts) + rng.choice([".", "!", "?", ",", ":"])


def corpus(lines: int = 3000) -> list[str]:
    """The training text: the same lines on every call."""
    rng = random.Random(SEED)
    return [_sentence(rng) for _ in range(lines)]


def train() -> Tokenizer:
    """A byte-level BPE over all 256 bytes plus merges learned from `corpus()`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # A ByteLevel decoder makes mlx-lm stream with its BPEStreamingDetokenizer.
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def write(directory: Path, max_length: int) -> Tokenizer:
    """Train the tokenizer and write `tokenizer.json` and `tokenizer_config.json`."""
    tok = train()
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": IM_END,
        "pad_token": PAD,
        "bos_token": None,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok


def partial_tokens(tok: Tokenizer) -> list[int]:
    """Ids of the tokens whose bytes are not valid UTF-8 on their own: a lone byte of a
    multi-byte character, or a merge that ends (or starts) mid-character."""
    decode = {v: k for k, v in _byte_encoder().items()}
    ids: list[int] = []
    for token, token_id in tok.get_vocab().items():
        if token in SPECIAL_TOKENS:
            continue
        try:
            bytes(decode[c] for c in token).decode("utf-8")
        except UnicodeDecodeError:
            ids.append(token_id)
    return sorted(ids)


def _byte_encoder() -> dict[int, str]:
    """GPT-2's byte-to-character table, which byte-level BPE tokens are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
