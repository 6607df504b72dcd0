"""What a runner owes Redis (exo_tasks.runner.outbox): its tokens and endings in one write per
step, its state published when its jobs come and go (batched) after the steps before it, kept
while Redis is down and sent once it is back, and a status move its state machine lacks refused
without a crash."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import pytest
import redis

from exo_tasks.fleet_types import RunnerStatus
from exo_tasks.runner import outbox as outbox_module
from exo_tasks.runner.outbox import Occupancy, Outbox
from exo_tasks.types import TokenEvent
from tests.unit.fakes import FakeClock, RunnerWrites, clock_of, new_job, runner

RS = RunnerStatus


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    return clock_of(monkeypatch, outbox_module)


@pytest.fixture
def store() -> RunnerWrites:
    return RunnerWrites()


class Jobs:
    """The runner's jobs, as the outbox asks for them."""

    def __init__(self) -> None:
        self.active = 0

    def occupancy(self) -> Occupancy:
        return Occupancy(self.active, largest_batch=self.active)


@pytest.fixture
def jobs() -> Jobs:
    return Jobs()


def outbox(store: RunnerWrites, jobs: Jobs, status: RunnerStatus = RS.READY) -> Outbox:
    return Outbox(store, runner(status), jobs.occupancy)


def token(index: int = 0) -> TokenEvent:
    return TokenEvent(index=index, text="x")


class TestPublish:
    def test_a_status_change_is_published_with_the_runners_jobs(
        self, store: RunnerWrites, jobs: Jobs
    ) -> None:
        box = outbox(store, jobs, RS.WARMING_UP)
        jobs.active = 2
        box.publish(RS.READY)
        assert [(s.status, s.active_jobs) for s in store.published] == [(RS.READY, 2)]

    def test_a_move_the_state_machine_lacks_is_refused_logged_and_not_raised(
        self, store: RunnerWrites, jobs: Jobs, caplog: pytest.LogCaptureFixture
    ) -> None:
        box = outbox(store, jobs, RS.SHUTDOWN)
        with caplog.at_level(logging.ERROR, logger="exo_tasks.lifecycle"):
            box.publish(RS.READY)
        assert store.published == [] and box.state.status == RS.SHUTDOWN
        assert "runner status change refused" in caplog.text

    def test_a_state_redis_refused_is_published_at_the_next_flush(
        self, store: RunnerWrites, jobs: Jobs
    ) -> None:
        box = outbox(store, jobs, RS.WARMING_UP)
        store.down = True
        box.publish(RS.READY)  # does not raise
        assert box.state_unpublished
        store.down = False
        box.flush(stopping=False)
        assert not box.state_unpublished
        box.drain()
        assert [s.status for s in store.published] == [RS.READY]


class TestFlush:
    def test_tokens_and_endings_then_the_runners_state_go_in_one_write(
        self, store: RunnerWrites, jobs: Jobs, clock: FakeClock
    ) -> None:
        box = outbox(store, jobs)
        jobs.active = 1
        box.jobs_changed()
        box.tokens.append(("j1", token()))
        box.flush(stopping=False)
        assert box.tokens == [] and box.endings == []
        box.drain()
        # With the tokens, at once (the job's state does not wait STATE_DELAY_S then), and in
        # their round trip: the loop waits for neither.
        assert [len(tokens) for tokens, _ in store.steps] == [1]
        assert [s.status for s in store.published] == [RS.RUNNING]
        assert store.round_trips == ["step"]

    def test_jobs_that_come_and_go_without_a_write_are_published_after_state_delay_s(
        self, store: RunnerWrites, jobs: Jobs, clock: FakeClock
    ) -> None:
        box = outbox(store, jobs)
        jobs.active = 1
        box.jobs_changed()
        box.flush(stopping=False)
        assert store.published == []  # too soon: a job that starts and ends costs no write
        clock.sleep(outbox_module.STATE_DELAY_S)
        box.flush(stopping=False)
        box.drain()
        assert [(s.status, s.active_jobs) for s in store.published] == [(RS.RUNNING, 1)]

    def test_a_job_that_came_and_went_between_two_flushes_costs_no_write(
        self, store: RunnerWrites, jobs: Jobs, clock: FakeClock
    ) -> None:
        box = outbox(store, jobs)
        box.flush(stopping=False)  # an earlier publish: the state as now
        box.jobs_changed()  # one came; it went before the delay was up
        clock.sleep(outbox_module.STATE_DELAY_S)
        box.flush(stopping=False)
        assert store.published == []

    def test_a_stop_keeps_its_status_whatever_the_jobs(
        self, store: RunnerWrites, jobs: Jobs, clock: FakeClock
    ) -> None:
        box = outbox(store, jobs, RS.SHUTTING_DOWN)
        jobs.active = 1
        box.jobs_changed()
        box.endings.append(new_job())
        box.flush(stopping=True)
        box.drain()
        assert [(s.status, s.active_jobs) for s in store.published] == [(RS.SHUTTING_DOWN, 1)]

    def test_what_redis_refused_is_kept_and_delivered_in_order_once_it_is_back(
        self, store: RunnerWrites, jobs: Jobs, clock: FakeClock
    ) -> None:
        box = outbox(store, jobs)
        box.tokens.append(("j1", token(0)))
        store.down = True
        with pytest.raises(redis.ConnectionError):  # at once if the writer's thread was quick
            box.flush(stopping=False)
            box.drain()
        box.tokens.append(("j1", token(1)))
        with pytest.raises(redis.ConnectionError):  # the runner waits, then flushes again
            box.flush(stopping=False)
        store.down = False
        box.flush(stopping=False)
        # The refused write alone first (it might have landed), then the one after it.
        assert [[t.index for _, t in tokens] for tokens, _ in store.steps] == [[0], [1]]


def test_amend_changes_the_state_without_publishing(store: RunnerWrites, jobs: Jobs) -> None:
    box = outbox(store, jobs)
    box.amend(pid=None, model_loads=2)
    assert store.published == [] and (box.state.pid, box.state.model_loads) == (None, 2)


def test_a_flush_marks_a_wait_for_redis_only_when_it_waits(
    store: RunnerWrites, jobs: Jobs, clock: FakeClock
) -> None:
    """Inside a wait, silence is no stall until the wait's own bound (60 s): a runner that hung
    in a wait marked on every step was not seen hung for that long (a SIGSTOPped runner's job
    in tests/test_shutdown.py, under load)."""
    waits: list[str] = []

    @contextlib.contextmanager
    def waiting() -> Iterator[None]:
        waits.append("wait")
        yield

    box = Outbox(store, runner(RS.READY), jobs.occupancy, waiting)
    for index in range(3):
        box.tokens.append(("j1", token(index)))
        box.flush(stopping=False)
    box.writer.drain()
    assert waits == []  # Redis answered: nothing was waited for
    store.down = True
    box.tokens.append(("j1", token(3)))
    with contextlib.suppress(redis.ConnectionError):  # raised here if the writer was quick
        box.flush(stopping=False)
    deadline = time.monotonic() + 5
    while not box.writer.failed():
        assert time.monotonic() < deadline, "the refused write never reported"
        time.sleep(0.01)
    with pytest.raises(redis.ConnectionError):
        box.flush(stopping=False)  # the loop asks again: that waits for Redis, marked so
    assert waits and set(waits) == {"wait"}
