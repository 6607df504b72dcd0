"""Prompt text the benchmarks send: text of about a given number of tokens of the model's own
tokenizer, made distinct by a seed (so that no prompt cache finds one prompt in another)."""

from __future__ import annotations

from tokenizers import Tokenizer


def text_of(tokenizer: Tokenizer, count: int, seed: str) -> str:
    """Text of about `count` tokens (words until the tokenizer counts them)."""
    words = f"{seed} the quick brown fox 世界 jumps over café lazy dogs while 😀 ideas grow".split()
    text = ""
    i = 0
    while len(tokenizer.encode(text).ids) < count:
        text += words[i % len(words)] + " "
        i += 1
    return text.strip()
