"""The runner supervisor's rules (exo_tasks.worker.supervisor, .runner_exits, .supervision),
against a fake store, fake runner processes and a fake clock: the stop escalation (ask → grace
→ SIGTERM → TERM_WAIT_S → SIGKILL → KILL_WAIT_S), and what a runner's exit leads to (a restart
with backoff, bounded; none for a configuration error or an idle unload). The waits are the
real ones, passed on the fake clock; tests/test_shutdown.py and friends run real processes."""

from __future__ import annotations

import itertools
import logging
import multiprocessing.connection
import os
import signal
import time
from typing import Any

import pytest

from exo_tasks.commands import RunnerCommand, StopRunner
from exo_tasks.fleet_types import RunnerStatus
from exo_tasks.runner import process as runner_process
from exo_tasks.runner.process import STACKS_SIGNAL, RankSpec, RunnerProgress
from exo_tasks.worker import runner_exits
from exo_tasks.worker import supervisor as supervisor_module
from exo_tasks.worker.ranks import RankKeeper
from exo_tasks.worker.supervision import (
    HEALTHY_UPTIME_S,
    KILL_WAIT_S,
    TERM_WAIT_S,
    restart_backoff_s,
)
from exo_tasks.worker.supervisor import RunnerSupervisor
from tests.unit.fakes import RUNNER_ID, FakeClock, FakeStore, runner, settings

RS = RunnerStatus
SIGTERM, SIGKILL = signal.SIGTERM, signal.SIGKILL


class FakeProcess:
    """A runner process: it exits when told to stop if it `obeys`, of the signals in `dies_of`."""

    pids = itertools.count(1000)

    def __init__(self, **_: Any) -> None:
        self.pid = next(self.pids)
        self.sentinel = object()
        self.exitcode: int | None = None
        self.signals: list[int] = []
        self.obeys = True
        self.dies_of = {SIGTERM, SIGKILL}

    def start(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass

    def signal(self, signum: int) -> None:
        self.signals.append(signum)
        if signum in self.dies_of:
            self.exitcode = -signum


class Host:
    """The machine under the supervisor: its spawned processes, signals and clock."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.processes: list[FakeProcess] = []
        self.stopped_at: list[tuple[int, float]] = []

    # multiprocessing's spawn context
    def Process(self, **kwargs: Any) -> FakeProcess:
        process = FakeProcess(**kwargs)
        self.processes.append(process)
        return process

    def Array(self, *_: Any, **__: Any) -> list[float]:
        return [0.0, 0.0, 0.0, 0.0]

    def kill(self, pid: int, signum: int) -> None:
        [process] = [p for p in self.processes if p.pid == pid]
        self.stopped_at.append((signum, self.clock.now))
        process.signal(signum)

    def wait(self, sentinels: list[Any], timeout: float | None = None) -> list[Any]:
        self.clock.sleep(timeout or 0.0)
        return [p.sentinel for p in self.processes if p.exitcode is not None]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def host(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> Host:
    fake = Host(clock)
    monkeypatch.setattr(supervisor_module, "_spawn", fake)
    monkeypatch.setattr(supervisor_module, "time", clock)
    monkeypatch.setattr(runner_exits, "time", clock)
    monkeypatch.setattr(os, "kill", fake.kill)
    monkeypatch.setattr(multiprocessing.connection, "wait", fake.wait)
    return fake


@pytest.fixture
def store(clock: FakeClock) -> FakeStore:
    return FakeStore(clock)


@pytest.fixture
def serving() -> list[tuple[str, bool]]:
    return []


@pytest.fixture
def supervisor(host: Host, store: FakeStore, serving: list[tuple[str, bool]]) -> RunnerSupervisor:
    unit = RunnerSupervisor(
        settings(runner_max_restarts=3),
        store.as_store,
        on_serving=lambda model, on: serving.append((model, on)),
    )
    unit._spawn(unit.handles[RUNNER_ID])
    return unit


def running(host: Host) -> FakeProcess:
    return host.processes[-1]


def runner_says(store: FakeStore, status: RunnerStatus, **update: Any) -> None:
    """What the runner itself published last."""
    store.runners.states[RUNNER_ID] = runner(status, **update)


def stops_when_told(store: FakeStore, process: FakeProcess) -> None:
    def answer(runner_id: str, command: RunnerCommand) -> None:
        if isinstance(command, StopRunner) and process.obeys:
            runner_says(store, RS.SHUTDOWN)
            process.exitcode = 0

    store.runners.on_send = answer


class TestEscalation:
    def stop(self, supervisor: RunnerSupervisor, grace_s: float = 10.0) -> str:
        return supervisor.stop_runner(RUNNER_ID, StopRunner(mode="warm", timeout_s=9), grace_s)

    def test_a_runner_that_stops_when_asked_gets_no_signal(
        self, supervisor: RunnerSupervisor, host: Host, store: FakeStore
    ) -> None:
        stops_when_told(store, running(host))
        assert self.stop(supervisor) == "exitcode=0"
        assert running(host).signals == []
        assert store.runners.states[RUNNER_ID].status == RS.SHUTDOWN  # a clean stop stands
        assert supervisor.handles[RUNNER_ID].process is None

    def test_past_the_grace_sigterm(
        self, supervisor: RunnerSupervisor, host: Host, store: FakeStore, clock: FakeClock
    ) -> None:
        running(host).obeys = False
        stops_when_told(store, running(host))
        asked_at = clock.now
        cause = self.stop(supervisor, grace_s=10.0)
        assert cause == "Terminated (signal 15 SIGTERM)"
        [(signum, at)] = host.stopped_at
        assert signum == SIGTERM and at - asked_at == pytest.approx(10.0)
        # Still the stop it was asked for: shut down, with the exit cause; its jobs failed.
        stopped = store.runners.states[RUNNER_ID]
        assert (stopped.status, stopped.error) == (RS.SHUTDOWN, cause)
        assert store.runners.failed_jobs == [(RUNNER_ID, f"runner {RUNNER_ID} stopped: {cause}")]

    def test_a_runner_that_said_shutdown_but_outlived_the_grace_stays_shut_down(
        self, supervisor: RunnerSupervisor, host: Host, store: FakeStore
    ) -> None:
        # As under load: it ends its jobs and says Shutdown, then exits too slowly.
        store.runners.on_send = lambda runner_id, command: runner_says(store, RS.SHUTDOWN)
        cause = supervisor.stop_runner(RUNNER_ID, StopRunner(mode="hard"), 1.0, on_purpose=True)
        assert cause == "Terminated (signal 15 SIGTERM)"
        stopped = store.runners.states[RUNNER_ID]
        assert (stopped.status, stopped.error) == (RS.SHUTDOWN, cause)
        assert stopped.is_down and supervisor.handles[RUNNER_ID].restart_at is None

    def test_a_runner_that_ignores_sigterm_gets_sigkill_after_term_wait_s(
        self, supervisor: RunnerSupervisor, host: Host, clock: FakeClock
    ) -> None:
        running(host).obeys, running(host).dies_of = False, {SIGKILL}
        assert self.stop(supervisor, grace_s=1.0) == "Terminated (signal 9 SIGKILL)"
        (term, term_at), (kill, kill_at) = host.stopped_at
        assert (term, kill) == (SIGTERM, SIGKILL)
        assert kill_at - term_at == pytest.approx(TERM_WAIT_S)

    def test_a_runner_that_survives_sigkill_is_given_up_on_loudly(
        self,
        supervisor: RunnerSupervisor,
        host: Host,
        clock: FakeClock,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        running(host).obeys, running(host).dies_of = False, set()
        asked_at = clock.now
        with caplog.at_level(logging.CRITICAL, logger="exo_tasks.supervisor"):
            assert self.stop(supervisor, grace_s=1.0) == "still running"
        assert "resources may have leaked" in caplog.text
        # Bounded: grace, then TERM_WAIT_S, then KILL_WAIT_S.
        assert clock.now - asked_at == pytest.approx(1.0 + TERM_WAIT_S + KILL_WAIT_S)

    def test_a_requeueing_stop_puts_the_runners_jobs_back(
        self, supervisor: RunnerSupervisor, host: Host, store: FakeStore
    ) -> None:
        stops_when_told(store, running(host))
        command = StopRunner(mode="warm", timeout_s=9, requeue=True)
        supervisor.stop_runner(RUNNER_ID, command, 10.0)
        assert store.runners.requeued_jobs == [RUNNER_ID] and store.runners.failed_jobs == []

    def test_stopping_a_runner_with_no_process_records_it_shut_down(
        self, supervisor: RunnerSupervisor, store: FakeStore, serving: list[tuple[str, bool]]
    ) -> None:
        supervisor.handles[RUNNER_ID].process = None
        runner_says(store, RS.UNLOADED)
        assert self.stop(supervisor) == "not running"
        assert store.runners.states[RUNNER_ID].status == RS.SHUTDOWN

    def test_an_operators_stop_takes_the_model_off_this_host(
        self,
        supervisor: RunnerSupervisor,
        host: Host,
        store: FakeStore,
        serving: list[tuple[str, bool]],
    ) -> None:
        stops_when_told(store, running(host))
        supervisor.stop_runner(RUNNER_ID, StopRunner(mode="hard"), 1.0, on_purpose=True)
        assert serving == [("tiny", False)]

    def hang(
        self,
        supervisor: RunnerSupervisor,
        host: Host,
        monkeypatch: pytest.MonkeyPatch,
        *,
        in_prefill: bool,
    ) -> None:
        """The runner, deaf to requests, has been silent past its stall limit with one job (no
        first token yet, or decoding); the supervisor's stops run at once."""
        monkeypatch.setattr(supervisor_module, "in_thread", lambda target, *args: target(*args))
        running(host).obeys = False
        settings = supervisor.settings
        limit_s = settings.prefill_timeout_s if in_prefill else settings.decode_timeout_s
        silent_since = time.monotonic() - limit_s - 1
        supervisor.handles[RUNNER_ID].progress = RunnerProgress([silent_since, 1, in_prefill, 0.0])

    def test_a_hung_runners_jobs_fail_at_once_and_it_gets_no_grace(
        self,
        supervisor: RunnerSupervisor,
        host: Host,
        store: FakeStore,
        clock: FakeClock,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        self.hang(supervisor, host, monkeypatch, in_prefill=True)
        asked_at = clock.now
        supervisor._check_stalls()
        assert store.runners.failed_jobs[0][0] == RUNNER_ID
        assert "stalled in prefill" in store.runners.failed_jobs[0][1]
        # Its stacks to the log first, then SIGTERM at once.
        assert host.stopped_at == [(STACKS_SIGNAL, asked_at), (SIGTERM, asked_at)]

    def test_a_hung_runner_is_stopped_though_redis_refuses_to_fail_its_jobs(
        self,
        supervisor: RunnerSupervisor,
        host: Host,
        store: FakeStore,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        self.hang(supervisor, host, monkeypatch, in_prefill=False)
        store.link.unreachable = 1
        supervisor._check_stalls()
        assert [signum for signum, _ in host.stopped_at] == [STACKS_SIGNAL, SIGTERM]
        [(runner_id, error)] = store.runners.failed_jobs  # by its exit, Redis being back
        assert runner_id == RUNNER_ID and error.startswith(f"runner {RUNNER_ID} failed: stalled")


class TestRestart:
    def crash(
        self, supervisor: RunnerSupervisor, host: Host, exitcode: int = 1, uptime_s: float = 1.0
    ) -> None:
        handle = supervisor.handles[RUNNER_ID]
        host.clock.sleep(uptime_s)
        running(host).exitcode = exitcode
        supervisor._on_exit(handle)

    def restart_when_due(self, supervisor: RunnerSupervisor, clock: FakeClock) -> None:
        handle = supervisor.handles[RUNNER_ID]
        assert handle.restart_at is not None
        clock.now = handle.restart_at
        supervisor._restart_due()

    def test_a_crash_fails_its_jobs_and_restarts_after_the_backoff(
        self, supervisor: RunnerSupervisor, host: Host, store: FakeStore, clock: FakeClock
    ) -> None:
        self.crash(supervisor, host)
        assert store.runners.failed_jobs == [(RUNNER_ID, f"runner {RUNNER_ID} failed: exitcode=1")]
        failed = store.runners.states[RUNNER_ID]
        assert failed.status == RS.FAILED and failed.next_restart_at is not None
        handle = supervisor.handles[RUNNER_ID]
        restart_at = handle.restart_at
        assert restart_at == pytest.approx(clock.now + restart_backoff_s(1))
        assert restart_at is not None
        clock.now = restart_at - 0.01
        supervisor._restart_due()
        assert len(host.processes) == 1  # not before its time
        self.restart_when_due(supervisor, clock)
        assert len(host.processes) == 2 and handle.restarts == 1
        reborn = store.runners.states[RUNNER_ID]
        assert (reborn.status, reborn.restarts) == (RS.WAITING_FOR_MODEL, 1)

    def test_crashes_in_a_row_double_the_backoff_up_to_30_s(self) -> None:
        assert [restart_backoff_s(n) for n in range(1, 9)] == [
            0.5,
            1.0,
            2.0,
            4.0,
            8.0,
            16.0,
            30.0,
            30.0,
        ]

    def test_a_runner_that_keeps_crashing_is_given_up_after_runner_max_restarts(
        self,
        supervisor: RunnerSupervisor,
        host: Host,
        store: FakeStore,
        clock: FakeClock,
        serving: list[tuple[str, bool]],
    ) -> None:
        delays = []
        for _ in range(3):  # runner_max_restarts
            self.crash(supervisor, host)
            handle = supervisor.handles[RUNNER_ID]
            restart_at = handle.restart_at
            assert restart_at is not None
            delays.append(restart_at - clock.now)
            self.restart_when_due(supervisor, clock)
        assert delays == [restart_backoff_s(n) for n in (1, 2, 3)]
        self.crash(supervisor, host)
        given_up = store.runners.states[RUNNER_ID]
        assert given_up.status == RS.FAILED and given_up.next_restart_at is None
        assert "gave up after 4 failures in a row" in (given_up.error or "")
        assert supervisor.handles[RUNNER_ID].restart_at is None
        assert serving == [("tiny", False)]

    def test_a_runner_that_stayed_up_a_while_starts_a_new_count(
        self, supervisor: RunnerSupervisor, host: Host, clock: FakeClock
    ) -> None:
        self.crash(supervisor, host)
        self.restart_when_due(supervisor, clock)
        self.crash(supervisor, host, uptime_s=HEALTHY_UPTIME_S + 1)
        assert supervisor.handles[RUNNER_ID].failures_in_a_row == 1

    def test_a_configuration_error_is_never_restarted(
        self, supervisor: RunnerSupervisor, host: Host, store: FakeStore
    ) -> None:
        self.crash(supervisor, host, exitcode=runner_process.EXIT_CONFIG)
        assert supervisor.handles[RUNNER_ID].restart_at is None
        assert "not restarted: a configuration error" in (
            store.runners.states[RUNNER_ID].error or ""
        )

    def test_the_runners_own_last_word_is_kept_beside_its_exit(
        self, supervisor: RunnerSupervisor, host: Host, store: FakeStore
    ) -> None:
        runner_says(store, RS.FAILED, error="model failed to load: no weights")
        self.crash(supervisor, host)
        assert (
            store.runners.states[RUNNER_ID].error == "model failed to load: no weights (exitcode=1)"
        )

    def test_an_idle_unload_is_no_failure_and_no_restart(
        self, supervisor: RunnerSupervisor, host: Host, store: FakeStore
    ) -> None:
        runner_says(store, RS.UNLOADED)
        self.crash(supervisor, host, exitcode=runner_process.EXIT_UNLOADED)
        handle = supervisor.handles[RUNNER_ID]
        assert handle.restart_at is None and handle.process is None
        assert store.runners.states[RUNNER_ID].status == RS.UNLOADED
        assert store.runners.requeued_jobs == [RUNNER_ID] and store.runners.failed_jobs == []


def test_a_stop_of_a_runner_whose_handle_is_gone_is_a_no_op(supervisor: RunnerSupervisor) -> None:
    """A rank's handle goes when it exits: a stop asked for just before (the worker's own stop,
    beside its instance's) finds none; it raised KeyError in its thread."""
    assert supervisor.stop_runner("inst-x.rank0", StopRunner(mode="hard"), 1.0) == "not running"


def test_a_stopping_worker_waits_for_its_ranks_exits_to_be_settled(
    supervisor: RunnerSupervisor, host: Host, store: FakeStore
) -> None:
    """A rank's exit is settled (its instance's records) in a thread of its own. A worker in a
    warm shutdown once exited while it ran: the rank's record said it still ran, and its
    instance never reached Failed (test_instance_faults, under load)."""
    settled: list[tuple[str, int]] = []

    def settle(handle: Any, exitcode: int, cause: str) -> None:
        time.sleep(0.3)  # a few Redis writes on a loaded machine
        settled.append((handle.spec.runner_id, exitcode))

    def stop_at_once(runner_id: str, command: RunnerCommand) -> None:
        assert isinstance(command, StopRunner)
        processes[runner_id].exitcode = 0

    rank = RankSpec(
        instance_id="inst-x", generation=1, rank=1, world=2, parallel="tensor", address="x"
    )
    whole = supervisor.handles[RUNNER_ID].spec
    supervisor.add_rank(whole.model_copy(update={"runner_id": "inst-x.rank1", "rank": rank}))
    processes = {RUNNER_ID: host.processes[0], "inst-x.rank1": running(host)}
    supervisor.on_rank_exit = settle
    store.runners.on_send = stop_at_once
    supervisor.stop()
    assert settled == [("inst-x.rank1", 0)]


def test_a_rank_stop_that_found_its_rank_gone_leaves_the_next_start_stoppable(
    supervisor: RunnerSupervisor, store: FakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rank keeper looks at a rank, then stops it; a rank that exited in between has no
    handle left, and the stop finds nothing. That stop once stayed marked under way for good:
    the next start of the rank (the same runner id) was never stopped when its instance failed,
    which never started again (seen in a suite run: rank 1 outlived rank 0 by minutes)."""
    asked: list[str] = []
    stop_runner = supervisor.stop_runner

    def counted(runner_id: str, *args: Any) -> str:
        asked.append(runner_id)
        return stop_runner(runner_id, *args)

    monkeypatch.setattr(supervisor, "stop_runner", counted)
    keeper = RankKeeper(settings(), store.as_store, supervisor, lambda *_: None)
    for tries in (1, 2):
        keeper._stop("inst-x.rank1", "now")
        deadline = time.monotonic() + 5.0  # the stop's own thread (this clock is the real one)
        while keeper._stopping and time.monotonic() < deadline:
            time.sleep(0.01)
        assert asked == ["inst-x.rank1"] * tries
