"""A job's own sampling inside a shared batch: its sampler, its logits processors and the log
probabilities it reports, built as mlx_lm.server builds them (mlx_lm.sample_utils).

BatchGenerator takes one sampler and one list of logits processors per sequence, so jobs with
different settings share a batch and each is sampled as it would be alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
    make_sampler,
)

from exo_tasks.types import SamplingParams
from exo_tasks.wire import TokenLogprob, TopLogprob

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
# Tokens the penalties look back over: mlx_lm.server's default context sizes.
PENALTY_CONTEXT = 20
# What a log probability of -inf is reported as (JSON has no infinity), as OpenAI does.
LOGPROB_FLOOR = -9999.0


class GuardedSampler:
    """A job's own sampler, kept from failing its batch: what it raises is kept (the engine
    fails the job after the step) and its row is sampled greedily meanwhile."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.error: str | None = None

    def __call__(self, logprobs: mx.array) -> mx.array:
        try:
            return self.sampler(logprobs)
        except Exception as exc:  # noqa: BLE001 (reported as the job's failure)
            self.error = self.error or f"sampling failed: {exc!r}"
            return mx.argmax(logprobs, axis=-1)


def _filters(params: SamplingParams) -> list[Callable[[mx.array], mx.array]]:
    """The truncations mlx-lm's make_sampler applies before sampling, in its order."""
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0.0 < params.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, params.min_p))
    if params.top_k > 0:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    return filters


def _seeded_sampler(params: SamplingParams, seed: int) -> Sampler:
    """A sampler with its own PRNG stream, so a seed gives the same text alone or in a batch.

    BatchGenerator calls a job's sampler once per sampled token, on that job's row only (a
    batch with more than one sampler is sampled row by row), so the key sequence is the job's.
    """
    key = mx.random.key(seed)
    filters = _filters(params)

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, step_key = mx.random.split(key)
        for apply in filters:
            logprobs = apply(logprobs)
        return mx.random.categorical(logprobs * (1.0 / params.temperature), key=step_key)

    return sample


class Samplers:
    """Each job's sampler. BatchGenerator samples the batch in one call only when every row
    has the same sampler object (else row by row), so jobs with equal settings share one."""

    def __init__(self) -> None:
        self._shared: dict[tuple[float, float, int, float], Sampler] = {}

    def for_job(self, params: SamplingParams) -> Sampler | None:
        """None: BatchGenerator's own greedy sampler."""
        if params.temperature == 0.0:
            return None
        if params.seed is not None:
            return GuardedSampler(_seeded_sampler(params, params.seed))
        setting = (params.temperature, params.top_p, params.top_k, params.min_p)
        if setting not in self._shared:
            self._shared[setting] = make_sampler(
                params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k
            )
        return self._shared[setting]


def first_token(
    logits: mx.array, prompt: list[int], processors: list[Any], sampler: Sampler | None
) -> tuple[int, mx.array]:
    """A prompt's first token from the logits at its last token, sampled as mlx-lm's generation
    batch samples a row: the job's logits processors with the prompt as their context, the log
    softmax, its sampler (None: greedy). The token and its row of log-probabilities."""
    context = mx.array(prompt)
    for processor in processors:
        logits = processor(context, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    token: Any = (sampler or greedy_sampler)(logprobs)  # one row: the token's id
    return int(token.item()), logprobs[0]


def check(params: SamplingParams, vocab_size: int) -> None:
    """ValueError for what only the model's vocabulary rules out (the API's door refuses it
    too, where it can read the model's tokenizer)."""
    refused = params.outside_vocabulary(vocab_size)
    if refused is not None:
        raise ValueError(": ".join(refused))


def logits_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """The job's logit bias and penalties, as mlx_lm.server makes them; [] when it has none."""
    processors: list[LogitsProcessor] = make_logits_processors(
        params.logit_bias or None,
        params.repetition_penalty or None,
        PENALTY_CONTEXT,
        params.presence_penalty or None,
        PENALTY_CONTEXT,
        params.frequency_penalty or None,
        PENALTY_CONTEXT,
    )
    return processors


def token_logprob(
    logprobs: mx.array, token: int, top: int, decode: Callable[[int], str]
) -> TokenLogprob:
    """A sampled token's log probability (after the job's logits processors, before its
    sampler's truncation, as in mlx_lm.server) and the `top` most likely tokens."""
    top_entries: list[TopLogprob] = []
    if top > 0:
        ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
        ids = ids[mx.argsort(-logprobs[ids])]  # most likely first
        # mlx's tolist() is typed for any nesting; these are flat lists of ints and floats.
        pairs: Any = zip(ids.tolist(), logprobs[ids].tolist(), strict=True)  # type: ignore[arg-type]
        top_entries = [_entry(i, v, decode) for i, v in pairs]
    value: Any = logprobs[token].item()
    chosen = _entry(token, value, decode)
    return TokenLogprob(**dict(chosen), top_logprobs=top_entries)


def _entry(token: int, logprob: float, decode: Callable[[int], str]) -> TopLogprob:
    text = decode(token)
    finite = logprob if math.isfinite(logprob) else LOGPROB_FLOOR
    return TopLogprob(token=text, logprob=finite, bytes=list(text.encode()))
