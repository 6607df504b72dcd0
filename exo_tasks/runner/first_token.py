"""A job's first token computed outside its lane's generator, from the logits at its prompt's
last token: the prefill process's (exo_tasks.runner.prefiller), or one forward pass for a
1-token job alone in an idle engine. mlx-lm's generator takes three steps to a prompt's first
token (the prompt but its last token, the last token, the token out); one pass is what mlx-lm's
own stream_generate computes: a lone 1-token job of the tiny model took 7.5 ms in the engine
that way, 4.5 ms this way (5.0 ms in stream_generate). A job the prefill process computed then
joins its lane from that state, as from a cached prefix, unless that token ended it. One pass
is kept to jobs their first token ends (`max_tokens` 1): a longer job joining its lane from a
one-pass state got its first token 25 ms sooner on the `bench` model but every later one 36 ms
later (the generator's pipeline starts over from that state: a step with no token)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from exo_tasks.runner import sampling
from exo_tasks.runner.lane import EngineFinish, Lane, LaneJob, TokenDelta
from exo_tasks.runner.prompt_cache import Lookup, PromptCache

# A job's first token, its log-probabilities, its end if it ended it, the prompt's KV state.
First = tuple[int, mx.array, EngineFinish | None, list[Any]]


def begin(job: LaneJob, logits: mx.array, cache: list[Any]) -> First:
    """The first token, sampled from the `logits` at the prompt's last token as the job's lane
    would, and the job set to go on from `cache` (the whole prompt's KV state) as from a cached
    prefix, unless that token ends it."""
    processors = job.insert["logits_processors"][0]
    token, logprobs = sampling.first_token(logits, job.prompt, processors, job.sampler)
    (max_tokens,) = job.insert["max_tokens"]
    finish: EngineFinish | None = "length" if max_tokens == 1 else None
    if job.insert["stop_sequences"][0].matcher().advance(token):
        finish = "stop"
    job.prefilled_elsewhere = True
    if finish is None:
        job.lookup = Lookup(cache, [token], len(job.prompt))
        job.insert = {**job.insert, "max_tokens": [max_tokens - 1]}
    return token, logprobs, finish, cache


def delta(
    job: LaneJob, first: First, eos_ids: frozenset[int], decode: Callable[[int], str]
) -> TokenDelta:
    """What the first token means for the job (LaneJob.take), or its own sampler's failure."""
    token, logprobs, finish, _ = first
    taken = job.take(token, logprobs, finish, eos_ids, decode)
    error = job.sampler_error
    return taken if error is None else TokenDelta(job.job_id, "", 0, None, error)


def start_alone(
    lanes: list[Lane], cache: PromptCache
) -> tuple[Lane, LaneJob, First | Exception] | None:
    """If a job waiting in one of `lanes` is alone in them, wants one token, and has at most a
    step's prefill left after its cached prefix (else None, its lookup kept for its lane): its
    token from one forward pass over that rest, with its lane and itself, or what the pass
    raised (the job's own failure, as at an insert)."""
    lane = next((lane for lane in lanes if lane.waiting), None)
    if lane is None or sum(map(len, lanes)) != 1:
        return None
    job = lane.waiting[0]
    if job.insert["max_tokens"] != [1] or job.lookup is not None or job.offloaded:
        return None
    lookup = job.lookup = lane.call(cache.fetch, job.prompt)
    if len(lookup.rest) > lane.prefill_step_size:
        return None
    lane.waiting.popleft()
    job.lookup, job.cached_tokens = None, lookup.cached_tokens
    try:
        return lane, job, lane.call(_one_pass, lane.model, job, lookup)
    except Exception as exc:  # noqa: BLE001 (the job's own failure)
        return lane, job, exc


def _one_pass(model: Any, job: LaneJob, lookup: Lookup) -> First:
    """On the lane's thread (an MLX stream is its thread's)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = lookup.cache if lookup.cache is not None else make_prompt_cache(model)
    logits = model(mx.array(lookup.rest)[None], cache=cache)[:, -1, :]
    mx.eval(logits, [c.state for c in cache])
    return begin(job, logits, cache)
