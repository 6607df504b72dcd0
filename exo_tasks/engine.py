"""Continuous batching for the runner: many jobs decode together in mlx-lm BatchGenerators.

The runner process owns the model and drives `BatchEngine.step()` in its loop; jobs are added
and removed between steps, while others are mid-generation. Not thread-safe: one caller only.

Jobs are spread over lanes: each lane is one BatchGenerator on its own MLX stream, driven by
its own thread (lane 0 by the caller's), and a step runs every lane at once. On a GPU one lane
is best (it is one device). On the CPU, MLX runs a stream's operations one after another on
one thread, so a single batch keeps one core busy however many there are; lanes keep them all
busy.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from exo_tasks import sampling
from exo_tasks.lane_threads import LaneThread, run_here
from exo_tasks.toolcalls import ToolCallSplitter, held_back, template_message
from exo_tasks.types import (
    ChatMessage,
    SamplingParams,
    TokenEvent,
)
from exo_tasks.wire import TokenLogprob, Tool, ToolCall

EngineFinish = Literal["stop", "length"]
T = TypeVar("T")
log = logging.getLogger("exo_tasks.engine")
MAX_AUTO_LANES = 8
# Small batches side by side are slower than one batch on the CPU (bench model, 2 cores: two
# lanes of 1 job make 17% fewer tokens/s than one lane of 2; two of 4, 7% more than one of 8;
# two of 16, 61% more than one of 32), so a lane is opened only once the busy ones hold this.
LANE_MIN_JOBS = 4
# Prompt tokens a lane prefills per step. A step is the stall watchdog's unit of progress, so
# it must stay short however long the prompt: on a 2-core CPU (`tiny`, 8,192 tokens) the last
# step took 6.1 s at mlx-lm's default of 2,048, 1.8 s at 512 and 1.2 s at 256, for the same
# total (12-13 s). Decoding jobs in the lane also wait one step for their next token.
PREFILL_STEP_SIZE = 256


def default_lanes() -> int:
    """One lane on a GPU; on the CPU one per core this process may use (up to MAX_AUTO_LANES)."""
    if mx.default_device() == mx.gpu:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, MAX_AUTO_LANES))


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

    def event(self, index: int) -> TokenEvent:
        """This delta on the job's event stream."""
        return TokenEvent(
            index=index,
            text=self.text,
            logprobs=self.logprobs or None,
            tool_calls=self.tool_calls or None,
        )


@dataclass
class _Job:
    job_id: str
    detokenizer: Any
    stop: list[str]
    sampler: Any  # its own GuardedSampler, or a shared one (or None: greedy)
    top_logprobs: int | None  # None: no logprobs asked for
    tools: ToolCallSplitter | None
    text: str = ""  # decoded so far, cut before a stop string once one is found
    published: int = 0  # length of the prefix of `text` already handed out
    tokens: int = 0

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


class _Lane:
    """A BatchGenerator and the one thread that drives it (an MLX stream belongs to its thread,
    so every call on the generator goes through that thread)."""

    def __init__(
        self,
        submit: Callable[..., Future[Any]],  # runs a call on the lane's thread
        model: Any,
        completion_batch_size: int,
        prefill_batch_size: int,
        prefill_step_size: int,
    ) -> None:
        self.submit = submit
        self.jobs: dict[int, _Job] = {}  # by generator uid
        self._make = functools.partial(
            BatchGenerator,
            model,
            completion_batch_size=completion_batch_size,
            prefill_batch_size=prefill_batch_size,
            prefill_step_size=prefill_step_size,
        )
        # Any: mlx-lm's methods are untyped, and it takes None in its samplers list (greedy).
        self.generator: Any = self.call(self._make)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        result: T = self.submit(fn, *args, **kwargs).result()
        return result

    def reset(self) -> None:
        """A fresh generator, empty, in place of one whose step failed (its state unknown)."""
        self.jobs.clear()
        with contextlib.suppress(Exception):
            self.call(self.generator.close)
        self.generator = self.call(self._make)

    def close(self) -> None:
        self.call(self.generator.remove, list(self.jobs))
        self.jobs.clear()
        self.call(self.generator.close)


class BatchEngine:
    """Jobs in, token deltas out: a thin, job-id-keyed layer over mlx-lm's BatchGenerators."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,  # mlx_lm TokenizerWrapper
        *,
        completion_batch_size: int = 32,
        prefill_batch_size: int = 8,
        prefill_step_size: int = PREFILL_STEP_SIZE,
        lanes: int | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._eos_ids = frozenset[int](tokenizer.eos_token_ids)
        # Stop-sequence automata are immutable (each request gets its own matcher): share them.
        self._stop_on_eos = StopSequences([[eos] for eos in sorted(self._eos_ids)])
        self._never_stop = StopSequences()
        # The batch limits are the engine's: a lane takes its share (a lane per job at most).
        count = min(lanes or default_lanes(), completion_batch_size)
        per_lane = math.ceil(completion_batch_size / count)
        # Lane 0 runs on the caller's thread: one lane (a GPU) costs no thread hop at all.
        submits = [run_here] + [LaneThread.number(i).submit for i in range(count - 1)]
        self._lanes = [
            _Lane(submit, model, per_lane, min(prefill_batch_size, per_lane), prefill_step_size)
            for submit in submits
        ]
        self._where: dict[str, tuple[_Lane, int]] = {}  # job id -> its lane and generator uid
        self._samplers = sampling.Samplers()
        self._vocab_size = len(tokenizer.get_vocab())
        self._largest_batch = 0
        self._prefill_chunks = 0

    @property
    def lanes(self) -> int:
        return len(self._lanes)

    @property
    def lane_jobs(self) -> list[int]:
        """How many jobs each lane holds."""
        return [len(lane.jobs) for lane in self._lanes]

    @property
    def active_jobs(self) -> int:
        return len(self._where)

    @property
    def prefill_chunks(self) -> int:
        """Prompt chunks the last step prefilled: progress even when no job sampled a token."""
        return self._prefill_chunks

    @property
    def largest_batch(self) -> int:
        """The most jobs ever decoding together in one generation step."""
        return self._largest_batch

    @property
    def tool_calling(self) -> bool:
        """Whether the model's chat template takes tools (mlx-lm knows its call markers)."""
        return bool(self._tokenizer.has_tool_calling)

    def encode(
        self,
        prompt: str | None,
        messages: list[ChatMessage] | None,
        tools: list[Tool] | None = None,
    ) -> list[int]:
        """Prompt tokens for a raw prompt, or for chat messages (and the tools the model may
        call) through the chat template."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if prompt is not None:
            return list(self._tokenizer.encode(prompt))
        if tools and not self.tool_calling:
            raise ValueError("tools: the model's chat template has no tool support")
        chat = [template_message(m) for m in messages or []]
        specs = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        return list(
            self._tokenizer.apply_chat_template(chat, tools=specs, add_generation_prompt=True)
        )

    def add(self, job_id: str, prompt_tokens: list[int], params: SamplingParams) -> None:
        """Queue a job; it joins the running batch on a later step."""
        # Checked here because one bad entry makes BatchGenerator.insert raise for all of it.
        if not prompt_tokens:
            raise ValueError(f"job {job_id}: empty prompt")
        if params.max_tokens <= 0:
            raise ValueError(f"job {job_id}: max_tokens must be > 0")
        if job_id in self._where:
            raise ValueError(f"job {job_id} is already in the engine")
        sampling.check(params, self._vocab_size)
        lane = self._lane_for_new_job()
        sampler = self._samplers.for_job(params)
        (uid,) = lane.call(
            lane.generator.insert,
            [prompt_tokens],
            max_tokens=[params.max_tokens],
            samplers=[sampler],
            logits_processors=[sampling.logits_processors(params)],
            stop_sequences=[self._never_stop if params.ignore_eos else self._stop_on_eos],
        )
        self._where[job_id] = (lane, uid)
        top = params.top_logprobs if params.logprobs else None
        lane.jobs[uid] = _Job(
            job_id,
            self._tokenizer.detokenizer,
            list(params.stop),
            sampler,
            top,
            self._tools(params),
        )

    def _tools(self, params: SamplingParams) -> ToolCallSplitter | None:
        """What takes the job's tool calls out of its text, if it gave tools to call."""
        if not (params.parses_tool_calls and self.tool_calling):
            return None
        t = self._tokenizer
        specs = [tool.model_dump(exclude_none=True) for tool in params.tools or []]
        return ToolCallSplitter(t.tool_call_start, t.tool_call_end, t.tool_parser, specs)

    def _lane_for_new_job(self) -> _Lane:
        """The lane with the fewest jobs, of the busy ones until each holds LANE_MIN_JOBS."""
        busy = [lane for lane in self._lanes if lane.jobs]
        if not busy or min(len(lane.jobs) for lane in busy) >= LANE_MIN_JOBS:
            busy = self._lanes
        return min(busy, key=lambda lane: len(lane.jobs))

    def remove(self, job_id: str) -> None:
        """Cancel a job in any phase; unknown or finished jobs are ignored (cancel races)."""
        where = self._where.pop(job_id, None)
        if where is not None:
            lane, uid = where
            del lane.jobs[uid]
            lane.call(lane.generator.remove, [uid])

    def step(self) -> list[TokenDelta]:
        """Run one prefill/decode step of every lane at once; one delta per job that sampled a
        token."""
        # Lane 0 runs here, when it is submitted: the others are started before it.
        busy = [lane for lane in reversed(self._lanes) if lane.jobs]
        running = [(lane, lane.submit(lane.generator.next)) for lane in busy]
        deltas: list[TokenDelta] = []
        batch = 0
        self._prefill_chunks = 0
        for lane, future in running:
            try:
                prompts, responses = future.result()
            except Exception as exc:  # noqa: BLE001 (one lane's failure is its jobs' alone)
                deltas.extend(self._lane_failed(lane, exc))
                continue
            # One prompt response per prompt in prefill; those at the end of their prompt only
            # moved to decoding.
            self._prefill_chunks += sum(1 for p in prompts if not p.end_of_prompt)
            batch += len(responses)
            deltas.extend(self._lane_deltas(lane, responses))
        self._largest_batch = max(self._largest_batch, batch)
        return deltas

    def _lane_deltas(self, lane: _Lane, responses: list[Any]) -> list[TokenDelta]:
        """One lane's step as deltas; a job whose token could not be decoded, or whose own
        sampler failed, fails alone."""
        deltas: list[TokenDelta] = []
        for r in responses:
            try:
                deltas.append(self._delta(lane, r))
            except Exception as exc:  # a detokenizer's failure is its job's alone
                log.exception("decoding a job's token failed")
                deltas.extend(self._fail(lane, [r.uid], f"decoding failed: {exc!r}"))
        for uid, job in list(lane.jobs.items()):
            if isinstance(job.sampler, sampling.GuardedSampler) and job.sampler.error:
                deltas.extend(self._fail(lane, [uid], job.sampler.error))
        return deltas

    def _lane_failed(self, lane: _Lane, exc: Exception) -> list[TokenDelta]:
        """A lane's step raised: its jobs fail and it starts over with a fresh generator; the
        other lanes are untouched. Retrying without the jobs in prefill is not safe: a
        BatchGenerator step decodes before it prefills, so a failure in prefill has already
        consumed the decoding jobs' tokens (lost, and a job that ended there never ends). A
        job's own sampler cannot get here (see sampling.GuardedSampler)."""
        log.error(
            "a lane's step failed; its jobs fail",
            exc_info=exc,
            extra={"jobs": [job.job_id for job in lane.jobs.values()]},
        )
        failures = self._fail(lane, list(lane.jobs), f"generation failed: {exc!r}")
        lane.reset()
        return failures

    def _fail(self, lane: _Lane, uids: list[int], error: str) -> list[TokenDelta]:
        """Take jobs out of a lane whose generator may be broken; a failure delta for each."""
        failures: list[TokenDelta] = []
        for uid in uids:
            job = lane.jobs.pop(uid, None)
            if job is None:
                continue
            self._where.pop(job.job_id, None)
            with contextlib.suppress(Exception):
                lane.call(lane.generator.remove, [uid])
            failures.append(TokenDelta(job.job_id, "", job.tokens, None, error))
        return failures

    def _delta(self, lane: _Lane, r: Any) -> TokenDelta:
        """What one generation response means for its job."""
        job = lane.jobs[r.uid]
        job.tokens += 1
        logprobs: list[TokenLogprob] = []
        if r.token not in self._eos_ids:  # EOS is never text, even with ignore_eos
            job.detokenizer.add_token(r.token)
            if job.top_logprobs is not None:
                logprobs.append(
                    sampling.token_logprob(r.logprobs, r.token, job.top_logprobs, self._decode)
                )
        if r.finish_reason is not None:
            job.detokenizer.finalize()
        text, hit_stop = job.feed(job.detokenizer.last_segment, r.finish_reason is not None)
        finish: EngineFinish | None = "stop" if hit_stop else r.finish_reason
        calls: list[ToolCall] = []
        if job.tools is not None:
            text, calls = job.tools.feed(text, finish is not None)
        if finish is not None:
            del lane.jobs[r.uid], self._where[job.job_id]
            if r.finish_reason is None:  # a stop string is ours; the generator's own it dropped
                lane.call(lane.generator.remove, [r.uid])
        return TokenDelta(job.job_id, text, job.tokens, finish, None, logprobs, calls)

    def _decode(self, token: int) -> str:
        return str(self._tokenizer.decode([token]))

    def warmup(self) -> None:
        """Run one short generation so the first real job does not pay for lazy setup.

        Call it before adding jobs: it gives every lane a job, steps until the engine is empty
        and drops the deltas.
        """
        params = SamplingParams.model_validate({"max_tokens": 4, "ignore_eos": True})
        for lane in range(self.lanes):
            self.add(f"__warmup_{lane}__", self.encode("warmup", None), params)
        while self._where:
            self.step()

    def close(self) -> None:
        """Drop every job and give back what the generators hold (the wired-memory limit)."""
        for lane in self._lanes:
            lane.close()
        self._where.clear()
