"""Continuous batching for the runner: many jobs decode together in mlx-lm BatchGenerators.

The runner process owns the model and drives `BatchEngine.step()` in its loop; jobs are added
and removed between steps, while others are mid-generation. Not thread-safe: one caller only.

Jobs are spread over lanes: each lane is one BatchGenerator on its own MLX stream, driven by
its own thread (lane 0 by the caller's), and a step runs every lane at once (but one, while a
prefill process computes a prompt beside them: `_parallel_lanes`). On a GPU one lane
is best (it is one device). On the CPU, MLX runs a stream's operations one after another on
one thread, so a single batch keeps one core busy however many there are; lanes keep them all
busy.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import StopSequences
from tokenizers import Tokenizer

from exo_tasks.runner import first_token, prefill_pace, sampling, toolcalls
from exo_tasks.runner.lane import (
    PREFILL_STEP_SIZE,
    Advance,
    Lane,
    LaneJob,
    TokenDelta,
    default_prefill_token_budget,
)
from exo_tasks.runner.lane_threads import LaneThread, default_lanes, lane_for_new_job, run_here
from exo_tasks.runner.prefiller import Prefiller
from exo_tasks.runner.prompt_cache import PromptCache
from exo_tasks.types import ChatMessage, SamplingParams
from exo_tasks.wire import Tool

log = logging.getLogger("exo_tasks.engine")


def weights_bytes(model: Any) -> int:
    """Bytes of the model's parameters in this process (a rank: its shard's)."""
    parameters: Any = tree_flatten(model.parameters())  # [(name, array)]
    return sum(int(v.nbytes) for _, v in parameters)


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
        prefill_token_budget: int | None = None,
        lanes: int | None = None,
        prompt_cache_bytes: int = 0,
        prefill_process: Prefiller | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._prefiller = prefill_process
        self.prompt_cache = PromptCache(prompt_cache_bytes)
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
            Lane(
                submit,
                model,
                per_lane,
                min(prefill_batch_size, per_lane),
                prefill_step_size,
                default_prefill_token_budget()
                if prefill_token_budget is None
                else prefill_token_budget,
            )
            for submit in submits
        ]
        for lane in self._lanes:
            lane.offload = prefill_process.takes if prefill_process else None
        self._where: dict[str, Lane] = {}  # job id -> its lane
        self._samplers = sampling.Samplers()
        self._vocab_size = len(tokenizer.get_vocab())
        self._largest_batch = 0
        self._weights_bytes = weights_bytes(model)
        self._prefill_chunks = 0

    @property
    def lanes(self) -> int:
        return len(self._lanes)

    @property
    def lane_jobs(self) -> list[int]:
        """How many jobs each lane holds."""
        return [len(lane) for lane in self._lanes]

    @property
    def prompt_cache_bytes(self) -> int:
        """Bytes of KV state the prompt cache holds."""
        return self.prompt_cache.nbytes

    @property
    def active_jobs(self) -> int:
        return len(self._where)

    @property
    def prefill_chunks(self) -> int:
        """Prompt chunks the last step prefilled: progress even when no job sampled a token."""
        return self._prefill_chunks

    @property
    def weights_bytes(self) -> int:
        """Bytes of the model's parameters this process holds (a rank: its shard's)."""
        return self._weights_bytes

    @property
    def memory(self) -> tuple[int, int]:
        """MLX's memory in this process, now and at its peak: the model, its caches, buffers."""
        return int(mx.get_active_memory()), int(mx.get_peak_memory())

    @property
    def largest_batch(self) -> int:
        """The most jobs ever decoding together in one generation step."""
        return self._largest_batch

    @property
    def prompt_tokenizer(self) -> Tokenizer | None:
        """The model's `tokenizers` tokenizer, if it has one: what the runner's intake counts a
        prompt with (exo_tasks.prompt_tokens), from its own thread. Only read, never changed:
        safe beside the loop's use of the tokenizer."""
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        return backend if isinstance(backend, Tokenizer) else None

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
        return toolcalls.encode(self._tokenizer, prompt, messages, tools)

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
        sampler = self._samplers.for_job(params)
        insert: dict[str, list[Any]] = {
            "max_tokens": [params.max_tokens],
            "samplers": [sampler],
            "logits_processors": [sampling.logits_processors(params)],
            "stop_sequences": [self._never_stop if params.ignore_eos else self._stop_on_eos],
        }
        top = params.top_logprobs if params.logprobs else None
        job = LaneJob(
            job_id,
            list(prompt_tokens),
            insert,
            self._tokenizer.detokenizer,
            list(params.stop),
            sampler,
            top,
            toolcalls.splitter(self._tokenizer, params),
        )
        lane = lane_for_new_job(self._lanes)
        lane.waiting.append(job)  # it joins the generator (and finds its prefix) in a step
        self._where[job_id] = lane

    def remove(self, job_id: str) -> None:
        """Cancel a job in any phase; unknown or finished jobs are ignored (cancel races)."""
        lane = self._where.pop(job_id, None)
        if lane is None:
            return
        if self._prefiller is not None:
            self._prefiller.cancel(job_id)
        for job in [j for j in (*lane.waiting, *lane.jobs.values()) if j.job_id == job_id]:
            if job.uid is None:
                lane.waiting.remove(job)
            else:
                del lane.jobs[job.uid]
                lane.take_out(job.uid, keep=False)

    def step(self) -> list[TokenDelta]:
        """Run one prefill/decode step of every lane; one delta per job that sampled a token
        (a first token from the prefill process, or a lone 1-token job's, included)."""
        first = self._rejoin(self._prefiller) if self._prefiller is not None else []
        lone = self._start_lone_job()  # the engine's only job, ended: no lane has a step to take
        self._prefill_chunks = 0
        deltas = first + (lone or self.admit_waiting() + self.advance(self.prefill_sizes()))
        if self._prefiller is not None:
            self._prefill_chunks += self._prefiller.take_chunks()
        return deltas

    def _rejoin(self, prefiller: Prefiller) -> list[TokenDelta]:
        """The jobs the prefill process is done with: each one's first token, sampled from the
        process's logits, and the job back to its lane, first in line, unless that token ended
        it (a prompt the process could not do goes back to be prefilled there)."""
        deltas: list[TokenDelta] = []
        for job, done in prefiller.finished(idle=not any(len(lane) for lane in self._lanes)):
            lane = self._where[job.job_id]
            first = lane.call(Prefiller.first_token, done, job) if done is not None else None
            if first is None:
                lane.waiting.appendleft(job)
            else:
                deltas.append(self._begun(lane, job, first))
        return deltas

    def _start_lone_job(self) -> list[TokenDelta]:
        """A 1-token job alone in an idle engine: its token from one pass (first_token)."""
        started = first_token.start_alone(self._lanes, self.prompt_cache)
        if started is None:
            return []
        lane, job, first = started
        if isinstance(first, Exception):
            return [self._not_started(job, first)]
        return [self._begun(lane, job, first)]

    def _begun(self, lane: Lane, job: LaneJob, first: first_token.First) -> TokenDelta:
        """A job's first token, computed outside its lane's generator: the job back to its
        lane, first in line, unless that token ended it (its prompt's state then cached)."""
        delta = first_token.delta(job, first, self._eos_ids, self._decode)
        if delta.finish_reason is None and delta.error is None:
            lane.waiting.appendleft(job)
            return delta
        del self._where[job.job_id]
        if delta.error is None:
            self.prompt_cache.store(job.prompt, first[3])
        return delta

    def admit_waiting(self) -> list[TokenDelta]:
        """A step's first part: let each lane's waiting jobs into its generator; a failure
        delta for each that could not join."""
        computing = [lane.jobs[uid] for lane in self._lanes for uid in lane.prefilling]
        return [d for lane in self._lanes for d in self._admit(lane, computing)]

    def prefill_sizes(self) -> list[int | None]:
        """The prompt tokens each lane's next step prefills (exo_tasks.runner.lane), sized by
        what its steps took on this host: an instance's followers are given rank 0's."""
        # Lanes step together: while a job decodes in any lane, every lane's prefill is paced.
        decoding = [lane.pace.decode_s for lane in self._lanes if lane.decoding]
        budget_s = prefill_pace.step_budget(decoding) if decoding else None
        return [lane.prefill_chunk(budget_s) for lane in self._lanes]

    def advance(self, chunks: list[int | None]) -> list[TokenDelta]:
        """A step's second part: every lane's prefill (`chunks`, one per lane) and decode."""
        keep = self.prompt_cache.enabled
        deltas: list[TokenDelta] = []
        # Lane 0 runs here, when it is submitted: the others are started before it.
        lanes = [
            (lane, chunk) for lane, chunk in zip(self._lanes, chunks, strict=True) if lane.jobs
        ]
        lanes.reverse()
        batch = 0
        self._prefill_chunks = 0
        width = self._parallel_lanes()
        for wave in (lanes[i : i + width] for i in range(0, len(lanes), width)):
            running = [(lane, lane.submit(lane.advance, keep, chunk)) for lane, chunk in wave]
            for lane, future in running:
                try:
                    advance = future.result()
                except Exception as exc:  # noqa: BLE001 (one lane's failure is its jobs' alone)
                    deltas.extend(self._lane_failed(lane, exc))
                    continue
                batch += len(advance.responses)
                deltas.extend(self._advanced(lane, advance))
        self._largest_batch = max(self._largest_batch, batch)
        return deltas

    def _parallel_lanes(self) -> int:
        """How many lanes step at once: one fewer while the prefill process computes a prompt,
        for it keeps a core busy as a lane does (more lanes than the cores left make every
        decoding job wait for the cores' sharing)."""
        if self._prefiller is not None and self._prefiller.computing:
            return max(1, len(self._lanes) - 1)
        return len(self._lanes)

    def _advanced(self, lane: Lane, advance: Advance) -> list[TokenDelta]:
        """A lane's step done: keep the KV states it gave, count its prefill, decode its tokens."""
        for cache, tokens in advance.snapshots:
            self.prompt_cache.store(tokens, cache)
        # One prompt response per prompt in prefill; those at the end of their prompt only
        # moved to decoding.
        self._prefill_chunks += sum(1 for p in advance.prompts if not p.end_of_prompt)
        return self._lane_deltas(lane, advance.responses)

    def _admit(self, lane: Lane, computing: list[LaneJob]) -> list[TokenDelta]:
        """Let a lane's waiting jobs into its generator; a failure delta for any that could
        not join (its own input, such as its cached state, made the insert raise)."""
        return [
            self._not_started(job, exc) for job, exc in lane.admit(self.prompt_cache, computing)
        ]

    def _not_started(self, job: LaneJob, exc: Exception) -> TokenDelta:
        """A job whose own input made its start raise: out of the engine, and its failure."""
        self._where.pop(job.job_id, None)
        return TokenDelta(job.job_id, "", 0, None, f"could not start: {exc!r}")

    def _lane_deltas(self, lane: Lane, responses: list[Any]) -> list[TokenDelta]:
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
            if job.sampler_error:
                deltas.extend(self._fail(lane, [uid], job.sampler_error))
        return deltas

    def _lane_failed(self, lane: Lane, exc: Exception) -> list[TokenDelta]:
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

    def _fail(self, lane: Lane, uids: list[int], error: str) -> list[TokenDelta]:
        """Take jobs out of a lane whose generator may be broken; a failure delta for each."""
        failures: list[TokenDelta] = []
        for uid in uids:
            job = lane.jobs.pop(uid, None)
            if job is None:
                continue
            self._where.pop(job.job_id, None)
            with contextlib.suppress(Exception):
                lane.take_out(uid, keep=False)
            failures.append(TokenDelta(job.job_id, "", job.tokens, None, error))
        return failures

    def _delta(self, lane: Lane, r: Any) -> TokenDelta:
        """What one generation response means for its job."""
        job = lane.jobs[r.uid]
        delta = job.take(r.token, r.logprobs, r.finish_reason, self._eos_ids, self._decode)
        if delta.finish_reason is not None:
            del lane.jobs[r.uid], self._where[job.job_id]
            if r.finish_reason is None:  # a stop string is ours; the generator's own it dropped
                kept = lane.take_out(r.uid, keep=self.prompt_cache.enabled)
                if kept is not None:
                    self.prompt_cache.store(kept[1], kept[0])
        return delta

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
        self.prompt_cache.clear()  # its prompt is nobody's

    def close(self) -> None:
        """Drop every job and give back what the generators hold (the wired-memory limit)."""
        for lane in self._lanes:
            lane.close()
        self._where.clear()
        if self._prefiller is not None:
            self._prefiller.close()
