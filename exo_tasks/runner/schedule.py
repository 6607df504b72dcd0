"""One schedule for every rank of an instance: rank 0 decides, the other ranks follow.

Rank 0's runner drives a `LeaderEngine` as a single-host runner drives its engine; every
decision it makes between two steps (a job added, with its prompt tokens and sampling settings,
a job removed) is recorded, and sent to the other ranks at the start of the next step, before
the model's own collectives. Each follower applies the same operations to its own engine, in
the same order, and steps: every rank then runs the same batch, so each enters the same
collectives and none waits on one the others will not enter. The rest is deterministic on every
rank (the model's outputs are the same on all: `all_sum` leaves identical bits everywhere), so
endings (EOS, `max_tokens`, stop strings) and the prompt cache stay in step too; the jobs the
leader's step ended travel with the next plan, and a follower that ended others fails, rather
than run a batch that is no longer rank 0's.

Sampling draws from each job's own key: rank 0 gives a seed to every job that samples and has
none, so all ranks draw the same tokens without sharing a random state.

An instance with no jobs does not wait on the ring: mlx's ring polls its socket while a
receive is pending, so a follower waiting there for the next plan kept a core busy for as long
as the instance was idle. Rank 0's step that empties its batch is followed by an `idle` plan;
each follower then waits off the ring, in Redis (`InstanceRecords.wait_for_wake`), until rank
0's next plan is on its way (`InstanceRecords.wake`).

The plan travels on the ring itself, as mlx_lm.server shares requests (`all_sum` of the bytes,
rank 0 alone giving them), on the generation stream the model runs on: on another stream it
could overtake a step still in flight, and the ranks would read each other's activations as a
plan (seen in the prototype).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from exo_tasks.runner.engine import BatchEngine
from exo_tasks.runner.lane import TokenDelta
from exo_tasks.runner.sigterm import Collectives
from exo_tasks.types import SamplingParams

log = logging.getLogger("exo_tasks.runner.schedule")


class AddJob(BaseModel):
    kind: Literal["add"] = "add"
    job_id: str
    prompt_tokens: list[int]
    params: SamplingParams


class RemoveJob(BaseModel):
    kind: Literal["remove"] = "remove"
    job_id: str


Operation = Annotated[AddJob | RemoveJob, Field(discriminator="kind")]
# What every rank does with a plan: a step, the warmup, leave (close), or wait off the ring.
Action = Literal["step", "warmup", "close", "idle"]


class StepPlan(BaseModel):
    """Rank 0's decision for one step, as every rank applies it."""

    action: Action = "step"
    ops: list[Operation] = []
    # The jobs rank 0's previous step ended (or failed): each follower's must be the same.
    ended: list[str] = []
    # The prompt tokens each lane's step prefills. Rank 0 sizes them by the time its own steps
    # take; a follower that sized its own by its clock would run other passes of the model and
    # wait in collectives rank 0 never enters.
    chunks: list[int | None] = []


class Diverged(RuntimeError):
    """A follower's engine no longer matches rank 0's."""


class PeerLost(BaseException):
    """The ring lost a peer (mlx raises RuntimeError('[ring] ...') once its socket closes).
    A BaseException: the batching loop must not end its jobs as a crash of its own; the
    supervisor fails them with the instance's cause (the rank that died first)."""


def is_ring_error(text: str) -> bool:
    return "[ring]" in text


class Channel:
    """Rank 0's plans to the other ranks, over the group's `all_sum`."""

    def __init__(self, group: Any) -> None:
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        self._mx, self._stream, self.group = mx, generation_stream, group

    def send(self, plan: StepPlan) -> None:
        mx = self._mx
        data = plan.model_dump_json().encode()
        with mx.stream(self._stream):
            mx.eval(mx.distributed.all_sum(mx.array(len(data)), group=self.group))
            mx.eval(mx.distributed.all_sum(mx.array(list(data), dtype=mx.uint8), group=self.group))

    def receive(self) -> StepPlan:
        mx = self._mx
        with mx.stream(self._stream):
            size = int(mx.distributed.all_sum(mx.array(0), group=self.group).item())
            data = mx.distributed.all_sum(mx.zeros(size, dtype=mx.uint8), group=self.group)
            mx.eval(data)
        return StepPlan.model_validate_json(bytes(memoryview(data)))


def ended_jobs(deltas: list[TokenDelta]) -> list[str]:
    return sorted(d.job_id for d in deltas if d.finish_reason is not None or d.error is not None)


class LeaderEngine:
    """Rank 0's engine: the runner's Engine, each step shared with the other ranks first."""

    def __init__(
        self,
        engine: BatchEngine,
        channel: Channel,
        collectives: Collectives,
        wake_followers: Callable[[], None],
    ) -> None:
        self.engine = engine
        self.channel = channel
        self.collectives = collectives  # where a SIGTERM finds the main thread
        self.wake_followers = wake_followers
        self._ops: list[Operation] = []
        self._ended: list[str] = []
        self._followers_idle = False

    lanes = property(lambda self: self.engine.lanes)
    largest_batch = property(lambda self: self.engine.largest_batch)
    prefill_chunks = property(lambda self: self.engine.prefill_chunks)
    tool_calling = property(lambda self: self.engine.tool_calling)
    prompt_cache_bytes = property(lambda self: self.engine.prompt_cache_bytes)
    weights_bytes = property(lambda self: self.engine.weights_bytes)
    memory = property(lambda self: self.engine.memory)
    prompt_tokenizer = property(lambda self: self.engine.prompt_tokenizer)
    encode = property(lambda self: self.engine.encode)  # rank 0 alone tokenizes

    def add(self, job_id: str, prompt_tokens: list[int], params: SamplingParams) -> None:
        if params.temperature > 0 and params.seed is None:
            params = params.model_copy(update={"seed": secrets.randbits(63)})
        self.engine.add(job_id, prompt_tokens, params)  # raises before it is recorded
        fields = set(SamplingParams.model_fields)
        shared = SamplingParams.model_validate(params.model_dump(include=fields))
        self._ops.append(AddJob(job_id=job_id, prompt_tokens=prompt_tokens, params=shared))

    def remove(self, job_id: str) -> None:
        self.engine.remove(job_id)
        self._ops.append(RemoveJob(job_id=job_id))

    def step(self) -> list[TokenDelta]:
        self._wake()
        with self.collectives.inside():
            failed = self.engine.admit_waiting()  # no collective: it only queues prompts
            chunks = self.engine.prefill_sizes()
            self._send("step", chunks)
            deltas = failed + self.engine.advance(chunks)
        # A collective inside the step that lost its peer fails the lane's jobs as deltas.
        lost = next((d.error for d in deltas if d.error and is_ring_error(d.error)), None)
        if lost is not None:
            raise PeerLost(lost)
        self._ended = ended_jobs(deltas)
        self._idle_if_empty()
        return deltas

    def warmup(self) -> None:
        self._wake()
        with self.collectives.inside():
            self._send("warmup")
            self.engine.warmup()
        self._idle_if_empty()

    def close(self) -> None:
        """Release the followers (they leave their loop), then the engine."""
        self._wake()
        with self.collectives.inside():
            self._send("close")
        self.engine.close()

    def _idle_if_empty(self) -> None:
        """No job left: the followers wait off the ring until the next plan (`_wake`)."""
        if self.engine.active_jobs or self._followers_idle:
            return
        with self.collectives.inside():
            self._send("idle")
        self._followers_idle = True

    def _wake(self) -> None:
        """Before a plan, the idle followers are told it comes (a Redis write: raises as the
        runner's other writes, nothing sent yet)."""
        if self._followers_idle:
            self.wake_followers()
            self._followers_idle = False

    def _send(self, action: Action, chunks: list[int | None] | None = None) -> None:
        plan = StepPlan(action=action, ops=self._ops, ended=self._ended, chunks=chunks or [])
        self._ops, self._ended = [], []
        try:
            self.channel.send(plan)
        except RuntimeError as exc:
            if is_ring_error(str(exc)):
                raise PeerLost(str(exc)) from exc
            raise


def follow(
    engine: BatchEngine,
    channel: Channel,
    stepping: Callable[[int, int], None],
    stepped: Callable[[], None],
    rest: Callable[[], None],
) -> None:
    """A follower's loop: apply rank 0's plans until it closes. `stepping(active jobs, jobs
    still without a first token)` as each step begins, `stepped()` once it ended: the
    supervisor's stall watchdog times a follower's steps alone. Its wait for the next plan
    is rank 0's to answer for (rank 0's own watchdog, its host's heartbeat, the ring's end
    when it dies): rank 0 may be waiting for Redis, which is no hang. After an `idle` plan,
    `rest()` returns once rank 0 says its next plan comes. Raises Diverged, or the ring's
    error."""
    ended: list[str] = []
    fresh: set[str] = set()  # jobs added that have not sampled a token yet
    while True:
        plan = channel.receive()
        if plan.ended != ended:
            raise Diverged(f"rank 0 ended {plan.ended}, this rank {ended}")
        for op in plan.ops:
            if isinstance(op, AddJob):
                engine.add(op.job_id, op.prompt_tokens, op.params)
                fresh.add(op.job_id)
            else:
                engine.remove(op.job_id)
                fresh.discard(op.job_id)
        if plan.action == "close":
            engine.close()
            return
        if plan.action == "idle":
            ended = []
            rest()
            continue
        if plan.action == "warmup":
            engine.warmup()
            ended = []
        else:
            stepping(engine.active_jobs, len(fresh))
            deltas = engine.admit_waiting() + engine.advance(plan.chunks)
            ended = ended_jobs(deltas)
            fresh.difference_update(d.job_id for d in deltas)
        stepped()
