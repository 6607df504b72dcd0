"""One lane of the batching engine: a BatchGenerator, the thread that drives it, and the jobs in
it, from the moment they wait to join it until their last token (`exo_tasks.runner.engine` steps the
lanes together).

A job waits in its lane until the generator has room to prefill it, and only then looks up its
prompt's longest cached prefix. It waits longer while a job in prefill (in any lane) computes at
least HOLD_MIN_TOKENS of its prompt that the cache does not have yet: jobs that arrive together
with one system prompt then prefill it once, and all reuse it, instead of all prefilling it side
by side.

With a token budget (on the CPU, where a step's time grows with the tokens it computes), a job
also waits while the lane's next step would prefill more than the budget, and a step prefills
each prompt up to where the shortest one ends. Every prompt in a step waits for the whole step
for its first token, so prompts prefilled a few at a time, shortest first, get their first
tokens sooner; and no prompt is padded to a longer one, so no token is computed for nothing.
A step always prefills at least one prompt.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator

from exo_tasks.runner import sampling
from exo_tasks.runner.prefill_pace import PrefillPace
from exo_tasks.runner.prompt_cache import Lookup, PromptCache
from exo_tasks.runner.toolcalls import ToolCallSplitter, held_back
from exo_tasks.types import TokenEvent
from exo_tasks.wire import TokenLogprob, ToolCall

EngineFinish = Literal["stop", "length"]
HOLD_MIN_TOKENS = 32
T = TypeVar("T")
# A KV state worth keeping, and the tokens it holds.
Snapshot = tuple[list[Any], list[int]]

# Prompt tokens a lane prefills per step at most. A step is the stall watchdog's unit of
# progress, so it must stay short however long the prompt: on a 2-core CPU (`tiny`, 8,192
# tokens) the last step took 6.1 s at mlx-lm's default of 2,048, 1.8 s at 512 and 1.2 s at
# 256, for the same total (12-13 s). While jobs decode, a CPU step is sized in time instead
# (exo_tasks.runner.prefill_pace): they wait for each step for their next token.
PREFILL_STEP_SIZE = 256
# Prompt tokens a lane's step may prefill on the CPU (a step is let to compute more only for one
# long prompt, or to let a shorter one join it). On the CPU a step's time grows with its tokens
# and nothing is gained by batching prompts (bench model, 2 cores: 17-22 ms a token from 8 to
# 256 tokens, alone or in rows), while every prompt in a step waits for the whole step for its
# first token: prompts prefilled one at a time get their first tokens sooner, at no cost in
# throughput. On a GPU a step's time grows far less than its tokens: no budget there.
PREFILL_TOKEN_BUDGET = 32


def default_prefill_token_budget() -> int:
    """Prompt tokens a lane's step may prefill: PREFILL_TOKEN_BUDGET on the CPU, no budget (0)
    on a GPU."""
    return 0 if mx.default_device() == mx.gpu else PREFILL_TOKEN_BUDGET


@dataclass(frozen=True)
class TokenDelta:
    """What one step produced for one job."""

    job_id: str
    text: str  # new text to publish (may be "" while a possible stop string is held back)
    completion_tokens: int  # tokens sampled so far, the EOS included (it counts to max_tokens)
    finish_reason: EngineFinish | None  # set on the job's last delta
    error: str | None = None  # set instead when the job failed: the engine dropped it
    logprobs: list[TokenLogprob] = field(default_factory=list)  # if the job asked for them
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls its text completed
    cached_tokens: int | None = None  # on the job's first delta: prompt tokens from the cache

    def event(self, index: int) -> TokenEvent:
        """This delta on the job's event stream."""
        return TokenEvent(
            index=index,
            text=self.text,
            tokens=self.completion_tokens,
            logprobs=self.logprobs or None,
            tool_calls=self.tool_calls or None,
        )


@dataclass
class LaneJob:
    job_id: str
    prompt: list[int]
    insert: dict[str, list[Any]]  # BatchGenerator.insert's per-sequence options, one each
    detokenizer: Any
    stop: list[str]
    sampler: Any  # its own GuardedSampler, or a shared one (or None: greedy)
    top_logprobs: int | None  # None: no logprobs asked for
    tools: ToolCallSplitter | None
    key: np.ndarray = field(init=False)  # the prompt, to compare with others'
    uid: int | None = None  # its generator's, once it has joined it
    lookup: Lookup | None = None  # its cached prefix, once looked up
    prefill_left: int = 0  # prompt tokens still to prefill, once it has joined the generator
    cached_tokens: int = 0
    offloaded: bool = False  # sent to the prefill process (once: never again)
    prefilled_elsewhere: bool = False  # its lookup is the prefill process's state, not a hit
    text: str = ""  # decoded so far, cut before a stop string once one is found
    published: int = 0  # length of the prefix of `text` already handed out
    tokens: int = 0

    def __post_init__(self) -> None:
        self.key = np.asarray(self.prompt)

    def awaits(self, computing: list[LaneJob]) -> bool:
        """Whether a job in prefill is computing enough of this job's prompt to wait for it."""
        for other in computing:
            n = min(len(self.key), len(other.key))
            differ = np.flatnonzero(self.key[:n] != other.key[:n])
            shared = int(differ[0]) if differ.size else n
            if shared - other.cached_tokens >= HOLD_MIN_TOKENS:
                return True
        return False

    @property
    def sampler_error(self) -> str | None:
        """What its own sampler raised, if it did (sampling.GuardedSampler)."""
        return self.sampler.error if isinstance(self.sampler, sampling.GuardedSampler) else None

    def take(
        self,
        token: int,
        logprobs: Any,  # the token's row of log-probabilities
        finish_reason: EngineFinish | None,  # the generator's
        eos_ids: frozenset[int],
        decode: Callable[[int], str],
    ) -> TokenDelta:
        """What one sampled token means for the job: its text (held back while it may start a
        stop string), log-probabilities, tool calls, and its end, a stop string's included."""
        self.tokens += 1
        top: list[TokenLogprob] = []
        if token not in eos_ids:  # EOS is never text, even with ignore_eos
            self.detokenizer.add_token(token)
            if self.top_logprobs is not None:
                top.append(sampling.token_logprob(logprobs, token, self.top_logprobs, decode))
        if finish_reason is not None:
            self.detokenizer.finalize()
        text, hit_stop = self.feed(self.detokenizer.last_segment, finish_reason is not None)
        finish: EngineFinish | None = "stop" if hit_stop else finish_reason
        calls: list[ToolCall] = []
        if self.tools is not None:
            text, calls = self.tools.feed(text, finish is not None)
        cached = self.cached_tokens if self.tokens == 1 else None
        return TokenDelta(self.job_id, text, self.tokens, finish, None, top, calls, cached)

    def feed(self, segment: str, final: bool) -> tuple[str, bool]:
        """Take newly decoded text; return the text safe to publish and whether a stop hit."""
        self.text += segment
        # Published text never ends in the start of a stop string, so a match starts after it.
        hits = [i for s in self.stop if (i := self.text.find(s, self.published)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            end = len(self.text)
        elif final:
            end = len(self.text)
        else:
            # Published text never ends in what could still grow into a stop string.
            end = len(self.text) - held_back(self.text, self.published, self.stop)
        out, self.published = self.text[self.published : end], end
        return out, bool(hits)


@dataclass
class Advance:
    """One step of a lane, as its thread saw it."""

    prompts: list[Any]  # the generator's prompt responses
    responses: list[Any]  # its generation responses
    snapshots: list[Snapshot]  # KV states of prompts just prefilled and sequences just ended


class Lane:
    """A BatchGenerator and the one thread that drives it (an MLX stream belongs to its thread,
    so every call on the generator goes through that thread)."""

    def __init__(
        self,
        submit: Callable[..., Future[Any]],  # runs a call on the lane's thread
        model: Any,
        completion_batch_size: int,
        prefill_batch_size: int,
        prefill_step_size: int,
        prefill_token_budget: int = 0,
    ) -> None:
        self.submit = submit
        self.model = model
        self.prefill_batch_size = prefill_batch_size
        self.prefill_step_size = prefill_step_size
        self.prefill_token_budget = prefill_token_budget  # 0: no budget
        self.jobs: dict[int, LaneJob] = {}  # in the generator, by uid
        self.waiting: deque[LaneJob] = deque()  # not yet in it
        self.prefilling: set[int] = set()  # uids still in prefill
        self.pace = PrefillPace()  # what its steps cost, measured as they run
        # Takes a job whose prompt has this much left to compute (the prefill process), or not.
        self.offload: Callable[[LaneJob, list[int]], bool] | None = None
        self._make = functools.partial(
            BatchGenerator,
            model,
            completion_batch_size=completion_batch_size,
            prefill_batch_size=prefill_batch_size,
            prefill_step_size=prefill_step_size,
        )
        # Any: mlx-lm's methods are untyped, and it takes None in its samplers list (greedy).
        self.generator: Any = self.call(self._make)

    def __len__(self) -> int:
        return len(self.jobs) + len(self.waiting)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        result: T = self.submit(fn, *args, **kwargs).result()
        return result

    def admit(
        self, cache: PromptCache, computing: list[LaneJob]
    ) -> list[tuple[LaneJob, Exception]]:
        """Move waiting jobs into the generator while it has room to prefill them, each from
        its prompt's longest cached prefix, unless one of the jobs `computing` their prompt
        (which the admitted join) is computing that prefix; in order, while the next step's
        prefill stays within the budget. The jobs that could not join, and why."""
        failed: list[tuple[LaneJob, Exception]] = []
        held: list[LaneJob] = []
        while self.waiting and len(self.prefilling) < self.prefill_batch_size:
            job = self.waiting.popleft()
            if cache.enabled and job.awaits(computing):
                held.append(job)
                continue
            try:
                # Looked up once: kept while the job waits for the budget (still a valid prefix).
                lookup = job.lookup = job.lookup or self.call(cache.fetch, job.prompt)
                if self._offloads(job, lookup.rest):
                    continue
                if not self._within_budget(len(lookup.rest)):
                    held.append(job)
                    break
                uid = self.call(self._insert, job, lookup)
            except Exception as exc:  # noqa: BLE001 (the job's own failure)
                failed.append((job, exc))
                continue
            self.jobs[uid] = job
            self.prefilling.add(uid)
            computing.append(job)
        self.waiting.extendleft(reversed(held))
        return failed

    def _offloads(self, job: LaneJob, rest: list[int]) -> bool:
        """Whether the prefill process took the job (it comes back to `waiting` once done)."""
        if self.offload is None or job.offloaded or not self.offload(job, rest):
            return False
        job.offloaded, job.lookup = True, None
        return True

    def _within_budget(self, rest: int) -> bool:
        """Whether a prompt with `rest` tokens to prefill may join the next step: if the step
        then computes no more tokens than the budget, or than it would without it (a short
        prompt may join a long one's step: the step stops where the short one ends)."""
        if not self.prefill_token_budget:
            return True
        before = self._computing([self.jobs[uid].prefill_left for uid in self.prefilling])
        if not before:
            return True
        after = [*before, *self._computing([rest])]
        cost_before = len(before) * self._chunk(before)
        return len(after) * self._chunk(after) <= max(self.prefill_token_budget, cost_before)

    @staticmethod
    def _computing(prefill_left: list[int]) -> list[int]:
        """Of prompts with these tokens left, the tokens a step may compute: all but the last
        token (the generator samples from it: it is the first decoding step's)."""
        return [left - 1 for left in prefill_left if left > 1]

    def _chunk(self, computing: list[int]) -> int:
        """The tokens of each prompt the next step computes, with a budget: up to where the
        shortest prompt ends, so that no prompt is padded to a longer one."""
        return min([self.prefill_step_size, *computing])

    def _insert(self, job: LaneJob, lookup: Lookup) -> int:
        (uid,) = self.generator.insert(
            [lookup.rest],
            caches=[lookup.cache],
            all_tokens=[job.prompt[: lookup.cached_tokens]],
            **job.insert,
        )
        job.uid, job.prefill_left = uid, len(lookup.rest)
        job.cached_tokens = 0 if job.prefilled_elsewhere else lookup.cached_tokens
        job.lookup = None  # the generator holds the state now
        return int(uid)

    @property
    def decoding(self) -> bool:
        """Whether a job of the lane is past its prompt (its next token waits for each step)."""
        return len(self.jobs) > len(self.prefilling)

    def prefill_chunk(self, budget_s: float | None) -> int | None:
        """The tokens of each prompt the next step prefills, with a token budget (on the CPU);
        `budget_s`: the time that prefill may take (None: no limit). None without a budget:
        the generator's own step size."""
        if not self.prefill_token_budget:
            return None
        computing = self._computing([self.jobs[uid].prefill_left for uid in self.prefilling])
        chunk = self._chunk(computing)
        return chunk if budget_s is None else self.pace.chunk(budget_s, len(computing), chunk)

    def advance(self, keep: bool, chunk: int | None = None) -> Advance:
        """The generator's next step, on the lane's thread; `keep`: with the KV states of the
        prompts it finished prefilling and the sequences it ended, evaluated here; `chunk`:
        the tokens of each prompt it prefills (`prefill_chunk`)."""
        decoding = self.decoding
        if chunk is not None:
            self.generator.prefill_step_size = chunk
        started = time.perf_counter()
        prompts, responses = self.generator.next()
        prefilled = 0
        for p in prompts:
            if (job := self.jobs.get(p.uid)) is not None:
                left = p.progress[1] - p.progress[0]
                prefilled += 0 if p.end_of_prompt else job.prefill_left - left
                job.prefill_left = left
        self.pace.observe(time.perf_counter() - started, prefilled, decoding)
        ended = [p.uid for p in prompts if p.end_of_prompt]
        self.prefilling.difference_update(ended)
        snapshots: list[Snapshot] = []
        if keep:
            snapshots = list(self.generator.extract_cache(ended).values())
            snapshots += [(r.prompt_cache, r.all_tokens) for r in responses if r.finish_reason]
            mx.eval([c.state for cache, _ in snapshots for c in cache])
        return Advance(prompts, responses, [(c, list(t)) for c, t in snapshots])

    def take_out(self, uid: int, keep: bool) -> Snapshot | None:
        """Remove a sequence the generator has not ended; its KV state if `keep`."""
        self.prefilling.discard(uid)
        removed = self.call(self._remove, uid, keep)
        return removed

    def _remove(self, uid: int, keep: bool) -> Snapshot | None:
        caches = self.generator.remove([uid], return_prompt_caches=keep)
        if uid not in caches:
            return None
        cache, tokens = caches[uid]
        mx.eval([c.state for c in cache])
        return cache, list(tokens)

    def reset(self) -> None:
        """A fresh generator, empty, in place of one whose step failed (its state unknown)."""
        self.jobs.clear()
        self.prefilling.clear()
        with contextlib.suppress(Exception):
            self.call(self.generator.close)
        self.generator = self.call(self._make)

    def close(self) -> None:
        self.call(self.generator.remove, list(self.jobs))
        self.jobs.clear()
        self.waiting.clear()
        self.prefilling.clear()
        self.call(self.generator.close)
