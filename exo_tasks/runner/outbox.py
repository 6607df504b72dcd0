"""What a runner owes Redis: its jobs' tokens and endings, the metrics observed with them, and
its own published state. Kept here while Redis is down and delivered in order once it is back,
so the jobs' streams stay complete. Each step's writes travel on a thread of their own
(`exo_tasks.runner.step_writer`), and the runner's state when its jobs came or went goes in
the same write, after them; every other write waits for them (`drain`), so that it follows
the steps before it. A wait for Redis is not silence for the stall watchdog (`waiting`):
a slow or paused Redis must not fail a runner's jobs as hung.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, NamedTuple, Protocol

import redis

from exo_tasks import lifecycle, metrics
from exo_tasks.fleet_types import RunnerState, RunnerStatus
from exo_tasks.runner.step_writer import Step, StepWriter, StepWrites
from exo_tasks.store.client import PipelineWrite
from exo_tasks.store.hosts import PrefixHint
from exo_tasks.store.runners import StateWrite
from exo_tasks.types import JobRecord, TokenEvent, utcnow

log = logging.getLogger("exo_tasks.runner")
# Publish a change in the runner's jobs with the next write, or after this long: a job that
# starts and ends in between costs no write at all.
STATE_DELAY_S = 0.05


class RunnerWrites(Protocol):
    def publish(self, state: RunnerState, *, status_changed: bool = True) -> None: ...


class OutboxStore(Protocol):
    """The store's writes that a runner makes (`exo_tasks.store.Store`'s runners and jobs)."""

    @property
    def runners(self) -> RunnerWrites: ...
    @property
    def jobs(self) -> StepWrites: ...


class Occupancy(NamedTuple):
    """The runner's jobs (what they left in its prompt cache, the memory its model uses) as
    its published state shows them."""

    active_jobs: int
    largest_batch: int
    prompt_cache_bytes: int = 0
    memory_bytes: int | None = None  # None: no model loaded
    peak_memory_bytes: int | None = None


class Outbox:
    def __init__(
        self,
        store: OutboxStore,
        state: RunnerState,
        occupancy: Callable[[], Occupancy],
        waiting: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        """`waiting`: around each wait for Redis (the stall watchdog's RunnerProgress)."""
        self.store = store
        self.waiting = waiting
        self.writer = StepWriter(store.jobs, state.id)
        self.state = state
        self.occupancy = occupancy
        self.tokens: list[tuple[str, TokenEvent]] = []
        self.endings: list[JobRecord] = []
        self.hints: list[PrefixHint] = []
        self.observations = metrics.Observations()
        self.state_unpublished = False
        self.state_due: float | None = None  # when the jobs' comings and goings get published

    def amend(self, **changes: Any) -> None:
        """Change the runner's state without publishing it (the next publish carries it)."""
        self.state = self.state.model_copy(update=changes)

    def count(self, metric: metrics.Metric, amount: float) -> None:
        self.observations.inc(metric, amount, model=self.state.model)

    def observe(self, metric: metrics.Metric, elapsed: timedelta, count: int = 1) -> None:
        self.observations.observe(metric, elapsed.total_seconds(), count, model=self.state.model)

    def publish(self, status: RunnerStatus | None = None, error: str | None = None) -> None:
        """Publish the runner's state, moved to `status` if given (exo_tasks.lifecycle's table
        refuses a move it does not have: nothing is published then), once the steps before it
        are in Redis."""
        changed = self._move(status, error)
        if changed is None:
            return
        try:
            self._deliver(self.state, status_changed=changed)
            self.state_unpublished = False
        except (redis.ConnectionError, redis.TimeoutError):
            self.state_unpublished = True  # published again once Redis is back

    def _move(
        self,
        status: RunnerStatus | None,
        error: str | None = None,
        occupancy: Occupancy | None = None,
    ) -> bool | None:
        """Move the state to `status` (None: as it is), with its jobs (`occupancy`, if already
        read) and the time now; whether its status changed (logged). None: the table refuses
        the move, and the state stays."""
        occupancy = self.occupancy() if occupancy is None else occupancy
        update: dict[str, Any] = {"updated_at": utcnow(), **occupancy._asdict()}
        if status is None:
            self.amend(**update)
            return False
        moved = lifecycle.move_runner(self.state, status, error=error, **update)
        if moved is None:
            return None
        changed = moved.status != self.state.status
        self.state = moved
        if changed:
            log.info("runner status %s", status, extra={"runner_status": status})
        return changed

    def restate(self) -> None:
        """Publish the runner's state as it is, over what another process wrote of it (a
        recovery loop that took this host for gone): a change of status in the store."""
        self._move(None)
        self._deliver(self.state)
        log.info("runner status %s restated", self.state.status)

    def drain(self) -> None:
        """Wait until every token and ending owed so far is in Redis (raises as `flush`)."""
        self._deliver(None)

    def _deliver(self, state: RunnerState | None, *, status_changed: bool = True) -> None:
        """Wait until every token and ending owed so far is in Redis, then publish `state`
        if given: all of it a wait for Redis."""
        with self.waiting():
            self._put()
            self.writer.drain()
            if state is not None:
                self.store.runners.publish(state, status_changed=status_changed)

    def jobs_changed(self) -> None:
        """Publish Running/Ready and active_jobs with the next tokens or endings, after them in
        their write (the client waiting on them does not wait for a write of its own), or after
        STATE_DELAY_S."""
        if self.state_due is None:
            self.state_due = time.monotonic() + STATE_DELAY_S

    def flush(self, *, stopping: bool) -> None:
        """Hand the tokens and job endings not yet in Redis, with the metrics observed since the
        last flush, to the writer's thread, and after them the runner's state if jobs came or
        went; raises what the last write raised, after trying it again. The loop waits for
        neither. `stopping`: the stop's status stands, whatever the jobs."""
        owed = bool(self.tokens or self.endings)
        due = self.state_due is not None and (owed or time.monotonic() >= self.state_due)
        self._put(self._jobs_state(stopping) if due or self.state_unpublished else None)
        # A wait only when there is one: a runner that hangs inside a wait counts as silent only
        # after the wait's own bound (60 s), so a wait marked on every step hid a hang of the
        # step's loop from the stall watchdog for that long.
        if self.writer.failed():
            with self.waiting():
                self.writer.drain()

    def _put(self, state: StateWrite | None = None) -> None:
        """Hand the tokens and endings not yet sent, with the metrics observed since the last
        ones, then `state`, to the writer's thread (nothing if there is none of them)."""
        if not (self.tokens or self.endings or state):
            return
        after: list[PipelineWrite] = [state] if state is not None else []
        self.writer.put(Step(self.tokens, self.observations, self.endings, self.hints, after))
        self.tokens, self.endings, self.hints = [], [], []
        self.observations = metrics.Observations()

    def _jobs_state(self, stopping: bool) -> StateWrite | None:
        """The runner's state as its jobs leave it: Running or Ready (a stop's status stands),
        and how many; None if the store shows it so already."""
        self.state_due = None
        occupancy = self.occupancy()
        status = self.state.status
        if not stopping:
            status = RunnerStatus.RUNNING if occupancy.active_jobs else RunnerStatus.READY
        # The model's memory changes with every step: published with the jobs, not for itself.
        unchanged = status == self.state.status and occupancy[:3] == (
            self.state.active_jobs,
            self.state.largest_batch,
            self.state.prompt_cache_bytes,
        )
        if unchanged and not self.state_unpublished:
            return None
        changed = self._move(status, occupancy=occupancy)
        if changed is None:
            return None
        self.state_unpublished = False  # the writer keeps it until Redis has it
        return StateWrite(self.state, changed)
