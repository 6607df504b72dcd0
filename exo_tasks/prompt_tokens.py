"""How many tokens a prompt is at least, counted with the model's own tokenizer, so that a
prompt over EXO_MAX_PROMPT_TOKENS is refused before a runner's batching loop ever sees it: at
the API's door (a 422) and at the runner's intake (a failed job).

The count is a lower bound of the runner's exact one (its tokenizer through mlx-lm, after the
chat template): the text's tokens without the special tokens the tokenizer adds; for chat
messages, each message's content alone less EDGE_TOKENS at each end (where the template's own
text may merge with it), and the template's own tokens not counted. So a prompt refused here is
over the cap for certain; one near the cap is left to the runner's exact count.

The `tokenizers` library reads a model's `tokenizer.json` without MLX: the API may use it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import Tokenizer

from exo_tasks.naming import model_path
from exo_tasks.types import ChatMessage

log = logging.getLogger("exo_tasks.prompt_tokens")
TOKENIZER_FILE = "tokenizer.json"
# Tokens at each end of a message's content that its chat template's text may take into its
# own (merged across the boundary): not counted.
EDGE_TOKENS = 2


class PromptTooLong(ValueError):
    """A prompt over the token cap for certain: `field` is the request's field."""

    def __init__(self, field: str, tokens: int, cap: int) -> None:
        self.field, self.tokens, self.cap = field, tokens, cap
        super().__init__(
            f"is at least {tokens} tokens with the model's tokenizer; "
            f"at most {cap} (EXO_MAX_PROMPT_TOKENS)"
        )


def load(model: str) -> Tokenizer | None:
    """The tokenizer of the model at `model` (a directory, or a hub id this host has in its
    Hugging Face cache; never fetched), or None if there is none to read."""
    path = model_path(model) / TOKENIZER_FILE
    if not path.is_file():
        path = _cached_hub_file(model) or path
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 (absent or unreadable: the runner counts alone)
        log.info("no tokenizer to count prompts with", extra={"model": model, "why": exc})
        return None


def _cached_hub_file(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, TOKENIZER_FILE)
    except Exception:  # noqa: BLE001 (not a hub id, or no cache)
        return None
    return Path(found) if isinstance(found, str) else None


def at_least(tokenizer: Tokenizer, prompt: str | None, messages: list[ChatMessage] | None) -> int:
    """A lower bound of the prompt's (or the messages') tokens after the chat template. The
    tokenizer runs without the GIL (encode_batch_fast): other threads go on meanwhile."""
    texts = [prompt] if prompt is not None else [m.content for m in messages or []]
    counts = [len(e.ids) for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    if prompt is not None:
        return counts[0]
    return sum(max(0, count - 2 * EDGE_TOKENS) for count in counts)


def check(
    tokenizer: Tokenizer, prompt: str | None, messages: list[ChatMessage] | None, cap: int
) -> None:
    """Raise PromptTooLong if the prompt is over `cap` tokens for certain."""
    tokens = at_least(tokenizer, prompt, messages)
    if tokens > cap:
        raise PromptTooLong("prompt" if prompt is not None else "messages", tokens, cap)
