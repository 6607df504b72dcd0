"""Small fakes of our own interfaces for the unit tests: the store (its jobs, streams, runners,
hosts and metrics parts, in memory, moving jobs by exo_tasks.lifecycle's table as the real
store's script does), a runner's writes, a Celery task as our tasks use it, and a clock. The
real-process tests run the real ones."""

from __future__ import annotations

import itertools
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, cast

import pytest
import redis

from config.settings import Settings
from exo_tasks import lifecycle
from exo_tasks.commands import RunnerCommand, SubmitJob, SupervisorRequest
from exo_tasks.fleet_types import RunnerState, RunnerStatus
from exo_tasks.recovery import host_of
from exo_tasks.store import Store
from exo_tasks.store.client import PipelineWrite
from exo_tasks.store.hosts import PrefixHint
from exo_tasks.store.runners import StateWrite
from exo_tasks.types import (
    DoneEvent,
    FinishReason,
    JobRecord,
    JobRequest,
    JobStatus,
    RequeuedEvent,
    TokenEvent,
)

HOST = "unit"
RUNNER_ID = f"tiny@{HOST}"
INCARNATION = f"{HOST}:1:1"


def settings(**values: Any) -> Settings:
    values = {"hostname": HOST, "models": "tiny", **values}
    return Settings(_env_file=None, **values)


def new_job(**update: Any) -> JobRecord:
    request = JobRequest.model_validate({"prompt": "hi", "max_tokens": 4})
    job = JobRecord(id=uuid.uuid4().hex, model="tiny", request=request)
    return job.model_copy(update=update)


def runner(status: RunnerStatus = RunnerStatus.READY, **update: Any) -> RunnerState:
    state = RunnerState(id=RUNNER_ID, host=HOST, model="tiny", status=status, pid=4242)
    return state.model_copy(update=update)


class Link:
    """The fakes' Redis link: `unreachable`: how many calls from now on raise as Redis does
    when it is down."""

    def __init__(self) -> None:
        self.unreachable = 0

    def reach(self) -> None:
        if self.unreachable:
            self.unreachable -= 1
            raise redis.ConnectionError("Connection refused (fake)")


class FakeStreams:
    """The store's stream part: each job's endings, and how many events it has. `interrupt`:
    raised by the next wait for an ending (a signal arriving in it). A wait with nothing to
    read passes its time on `clock`."""

    def __init__(self, link: Link, clock: FakeClock, runners: dict[str, RunnerState]) -> None:
        self.link, self.clock, self.runners = link, clock, runners
        self.interrupt: BaseException | None = None
        self.endings: dict[str, list[tuple[str, DoneEvent | RequeuedEvent]]] = defaultdict(list)
        self.events: dict[str, int] = defaultdict(int)
        self._ids = itertools.count(1)

    def append(self, job_id: str, ending: DoneEvent | RequeuedEvent) -> None:
        self.endings[job_id].append((f"{next(self._ids)}-0", ending))

    def streamed_text(self, job_id: str) -> tuple[str, int]:
        return "", 0

    def read_endings(
        self, job_id: str, after: str, block_ms: int
    ) -> list[tuple[str, DoneEvent | RequeuedEvent]]:
        self.link.reach()
        if self.interrupt is not None:
            interrupt, self.interrupt = self.interrupt, None
            raise interrupt
        position = int(after.split("-")[0])
        found = [(i, e) for i, e in self.endings[job_id] if int(i.split("-")[0]) > position]
        if not found:
            self.clock.sleep(block_ms / 1000)
        return found

    def attempt_start(self, job_id: str) -> tuple[str, int]:
        endings = self.endings[job_id]
        return (endings[-1][0] if endings else "0-0"), self.events[job_id]

    def runner_and_events(self, runner_id: str, job_id: str) -> tuple[RunnerState | None, int]:
        self.link.reach()
        return self.runners.get(runner_id), self.events[job_id]


class FakeJobs:
    """The store's job part; its moves append their endings to `streams`."""

    def __init__(self, link: Link, streams: FakeStreams) -> None:
        self.link, self.streams, self.runners = link, streams, streams.runners
        self.records: dict[str, JobRecord] = {}
        self.cancel_requested: dict[str, str] = {}
        self.waiting_messages: set[str] = set()  # jobs whose message waits in its queue

    def add(self, job: JobRecord) -> JobRecord:
        self.records[job.id] = job
        return job

    def get(self, job_id: str) -> JobRecord | None:
        self.link.reach()
        return self.records.get(job_id)

    def with_runner(
        self, job_id: str, runner_id: str
    ) -> tuple[JobRecord | None, RunnerState | None]:
        self.link.reach()
        return self.records.get(job_id), self.runners.get(runner_id)

    def apply(self, move: lifecycle.Move) -> bool:
        job = self.records.get(move.record.id)
        if job is None or job.status not in move.allowed_from:
            return False
        if move.owner is not None and job.owner != move.owner:
            return False
        self.records[job.id] = record = move.record
        if record.is_terminal:
            self.streams.append(job.id, DoneEvent(event=lifecycle.ending_event(record), job=record))
        elif isinstance(move.event, RequeuedEvent):
            self.streams.append(job.id, move.event)
        return True

    def end(
        self,
        job_id: str,
        status: JobStatus,
        *,
        finish_reason: FinishReason | None = None,
        error: str | None = None,
    ) -> bool:
        job = self.get(job_id)
        if job is None or job.is_terminal:
            return False
        move = lifecycle.end(
            job, status, text="", finish_reason=finish_reason, completion_tokens=0, error=error
        )
        return self.apply(move)

    def fail(self, job_id: str, error: str) -> bool:
        return self.end(job_id, JobStatus.FAILED, error=error)

    def requeue(self, job_id: str, *, only_from: str | None = None) -> JobRecord | None:
        job = self.records.get(job_id)
        if job is None or job.is_terminal or (only_from is not None and job.owner != only_from):
            return None
        move = lifecycle.requeue(job, only_from_owner=only_from is not None)
        return move.record if self.apply(move) else None

    def request_cancel(self, job_id: str, by: str) -> None:
        self.link.reach()
        self.cancel_requested.setdefault(job_id, str(by))

    def withdraw_message(self, job_id: str) -> bool:
        self.link.reach()
        if job_id not in self.waiting_messages:
            return False
        self.waiting_messages.remove(job_id)
        return True

    def cancel_reason(self, job_id: str) -> str | None:
        self.link.reach()
        return self.cancel_requested.get(job_id)


class FakeRunners:
    """The store's runner part. `on_send`: a runner's answer to a command."""

    def __init__(self, link: Link, jobs: FakeJobs) -> None:
        self.link, self.jobs = link, jobs
        self.states = jobs.runners
        self.inboxes: dict[str, list[RunnerCommand]] = defaultdict(list)
        self.published: list[RunnerState] = []
        self.failed_jobs: list[tuple[str, str]] = []
        self.requeued_jobs: list[str] = []
        self.on_send: Callable[[str, RunnerCommand], None] = lambda runner_id, command: None

    def get(self, runner_id: str) -> RunnerState | None:
        self.link.reach()
        return self.states.get(runner_id)

    def publish(self, state: RunnerState, *, status_changed: bool = True) -> None:
        self.link.reach()
        self.states[state.id] = state
        self.published.append(state)

    def hand_over(self, runner_id: str, command: SubmitJob) -> bool:
        self.link.reach()
        if not self.jobs.apply(lifecycle.Move(command.job, lifecycle.HAND_OVER_FROM)):
            return False
        self.send(runner_id, command)
        return True

    def send(self, runner_id: str, command: RunnerCommand) -> None:
        self.inboxes[runner_id].append(command)
        self.on_send(runner_id, command)

    def drop_inbox(self, runner_id: str) -> None:
        self.link.reach()
        self.inboxes.pop(runner_id, None)

    def fail_jobs(self, runner_id: str, error: str) -> list[str]:
        self.link.reach()
        self.failed_jobs.append((runner_id, error))
        return []

    def requeue_jobs(self, runner_id: str) -> list[str]:
        self.requeued_jobs.append(runner_id)
        return []


class FakeHosts:
    """The store's host part. `on_supervisor`: a supervisor's answer to a request."""

    def __init__(self) -> None:
        self.live_owners: set[str] = {INCARNATION}
        self.to_supervisors: list[tuple[str, SupervisorRequest]] = []
        self.on_supervisor: Callable[[SupervisorRequest], None] = lambda request: None

    def owner_is_live(self, job: JobRecord) -> bool:
        return job.owner is None or job.owner in self.live_owners

    def get(self, host: str) -> str | None:
        """A host's heartbeat (here its name) while an incarnation of it beats."""
        return host if any(host_of(owner) == host for owner in self.live_owners) else None

    def send_to_supervisor(self, host: str, request: SupervisorRequest) -> None:
        self.to_supervisors.append((host, request))
        self.on_supervisor(request)


class FakeMetrics:
    def write(self, observations: Any) -> None:
        pass


class FakeStore:
    """The store's job, stream, runner, host and metric parts our Celery-side code uses, in memory,
    over one fake link to Redis (`link.unreachable`)."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.clock = clock or FakeClock()
        self.link = Link()
        self.streams = FakeStreams(self.link, self.clock, {})
        self.jobs = FakeJobs(self.link, self.streams)
        self.runners = FakeRunners(self.link, self.jobs)
        self.hosts = FakeHosts()
        self.metrics = FakeMetrics()
        self.connections_dropped = 0

    @property
    def as_store(self) -> Store:
        return cast(Store, self)

    def drop_connections(self) -> None:
        self.connections_dropped += 1


class RunnerWrites:
    """The two writes a runner makes, kept: its state (`runners.publish`) and its steps
    (`jobs.write_step`). `down`: Redis refuses them."""

    def __init__(self) -> None:
        self.published: list[RunnerState] = []
        self.steps: list[tuple[list[tuple[str, TokenEvent]], list[JobRecord]]] = []
        self.step_marks: list[str] = []
        self.hints: list[PrefixHint] = []
        self.round_trips: list[str] = []  # "step" or "state", as each write went
        self.down = False
        self.runners = _StatePublisher(self)
        self.jobs = _StepWriter(self)

    def reach(self) -> None:
        if self.down:
            raise redis.ConnectionError("Connection refused (fake)")


class _StatePublisher:
    def __init__(self, writes: RunnerWrites) -> None:
        self.writes = writes

    def publish(self, state: RunnerState, *, status_changed: bool = True) -> None:
        self.writes.reach()
        self.writes.round_trips.append("state")
        self.writes.published.append(state)


class _StepWriter:
    def __init__(self, writes: RunnerWrites) -> None:
        self.writes = writes

    def write_step(
        self,
        runner_id: str,
        tokens: list[tuple[str, TokenEvent]],
        observations: Any,
        endings: list[JobRecord],
        hints: list[PrefixHint],
        mark: str,
        after: Sequence[PipelineWrite] = (),
    ) -> None:
        self.writes.reach()
        self.writes.round_trips.append("step")
        self.writes.steps.append((list(tokens), list(endings)))
        self.writes.hints += hints
        self.writes.step_marks.append(mark)
        # The runner's state goes with its step (a StateWrite): kept as publish keeps it.
        self.writes.published += [write.state for write in after if isinstance(write, StateWrite)]

    def step_written(self, runner_id: str, mark: str) -> bool:
        self.writes.reach()
        return mark in self.writes.step_marks


@dataclass
class FakeRequest:
    """What our tasks read of Celery's task request."""

    delivery_info: dict[str, Any] = field(default_factory=dict)
    timelimit: tuple[float | None, float | None] | None = None


class FakeBackend:
    def __init__(self) -> None:
        self.revoked: list[str] = []
        self.reasons: list[str] = []
        self.fails = False

    def mark_as_revoked(self, task_id: str, reason: str, request: Any = None) -> None:
        if self.fails:
            raise redis.ConnectionError("Connection refused (fake)")
        self.revoked.append(task_id)
        self.reasons.append(reason)


@dataclass
class FakeApp:
    store: FakeStore
    settings: Settings
    incarnation: str = INCARNATION
    backend: FakeBackend = field(default_factory=FakeBackend)


class FakeTask:
    """A Celery task as our task bodies and task_states use it: its app, request, state
    updates, events and backend."""

    name = "exo.inference"

    def __init__(self, store: FakeStore, **settings_values: Any) -> None:
        self.app = FakeApp(store, settings(**settings_values))
        self.request = FakeRequest()
        self.backend = FakeBackend()
        self.states: list[tuple[str, dict[str, Any]]] = []
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.store_fails = False

    def update_state(self, *, state: str, meta: dict[str, Any]) -> None:
        if self.store_fails:
            raise redis.ConnectionError("Connection refused (fake)")
        self.states.append((state, meta))

    def send_event(self, event: str, *, retry: bool, **fields: Any) -> None:
        self.sent.append((event, fields))


class FakeClock:
    """time.monotonic, time.time and time.sleep for code that waits: a sleep passes at once. A
    wait that would outlast a day fails the test, rather than spin for ever."""

    START = 1000.0
    HORIZON_S = 24 * 3600.0

    def __init__(self) -> None:
        self.now = self.START

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        assert self.now - self.START < self.HORIZON_S, "a wait that never ends"


def clock_of(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> FakeClock:
    """A fake clock in place of `module`'s `time`, for the test's length."""
    clock = FakeClock()
    monkeypatch.setattr(module, "time", clock)
    return clock
