"""A runner's prompt cache: the KV state of recent prompts and finished conversations, shared by
all the jobs of the runner, reused for the longest cached prefix of a new job.

It is mlx-lm's `LRUPromptCache` (a token trie with an LRU bounded by bytes, as mlx_lm.server
uses it), held by the engine and touched only from the engine's caller thread. What it holds
lives in the runner process alone: a restart starts cold, and a runner serves one model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

# The trie's key for the model: one runner, one model.
_MODEL = "model"
# Entries are bounded by bytes; the count is bounded only so high it never decides.
_MAX_ENTRIES = 1 << 20


@dataclass(frozen=True)
class Lookup:
    """A job's prefix lookup: the KV state to start from (None: from scratch) and what is left
    to prefill, never empty (a prompt needs a last token to sample from)."""

    cache: list[Any] | None
    rest: list[int]
    cached_tokens: int


class PromptCache:
    """An LRU of KV states bounded by `max_bytes` (0: the cache is off)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lru = LRUPromptCache(max_size=_MAX_ENTRIES, max_bytes=max_bytes)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def nbytes(self) -> int:
        return int(self._lru.nbytes)

    def __len__(self) -> int:
        return len(self._lru)

    def fetch(self, tokens: list[int]) -> Lookup:
        """A private copy of the state of the longest cached prefix of `tokens`.

        Call it on the thread that will use the state (an MLX stream belongs to its thread):
        the copy is evaluated there.
        """
        if not self.enabled:
            return Lookup(None, tokens, 0)
        cache, rest = self._lru.fetch_nearest_cache(_MODEL, tokens)
        if cache is None:
            return Lookup(None, tokens, 0)
        if not rest:  # the whole prompt is cached: step back one token to sample from
            if not can_trim_prompt_cache(cache):
                return Lookup(None, tokens, 0)
            trim_prompt_cache(cache, 1)
            rest = tokens[-1:]
        mx.eval([c.state for c in cache])
        return Lookup(cache, list(rest), len(tokens) - len(rest))

    def store(self, tokens: list[int], cache: list[Any]) -> None:
        """Keep the KV state of `tokens` (evaluated already); the least recently used entries
        go until the bytes are within the bound. Shorter cached prefixes of `tokens` go too."""
        if self.enabled and tokens and cache:
            self._lru.insert_cache(_MODEL, list(tokens), cache)

    def clear(self) -> None:
        self._lru.trim_to(n_sequences=0)
