"""The job state machine's table and moves, pure: no Redis, no processes."""

from __future__ import annotations

import uuid

import pytest

from exo_tasks import lifecycle
from exo_tasks.fleet_types import RunnerState, RunnerStatus
from exo_tasks.lifecycle import Delivery
from exo_tasks.types import (
    TERMINAL_JOB_STATUSES,
    JobRecord,
    JobRequest,
    JobStatus,
    RequeuedEvent,
    utcnow,
)

Q, R = JobStatus.QUEUED, JobStatus.RUNNING
S, F, C, T = JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.TIMED_OUT


def new_job(**update: object) -> JobRecord:
    request = JobRequest.model_validate({"prompt": "hi", "max_tokens": 4})
    return JobRecord(id=uuid.uuid4().hex, model="m", request=request).model_copy(update=update)


def test_every_status_has_its_moves() -> None:
    assert set(lifecycle.TRANSITIONS) == set(JobStatus)


def test_an_ended_job_never_moves_again() -> None:
    for ending in TERMINAL_JOB_STATUSES:
        assert lifecycle.TRANSITIONS[ending] == frozenset()
        assert ending.is_terminal
    assert lifecycle.ENDINGS == TERMINAL_JOB_STATUSES


@pytest.mark.parametrize(
    ("current", "to", "allowed"),
    [
        (Q, R, True),
        (Q, C, True),
        (Q, T, True),
        (Q, F, True),
        (Q, Q, True),  # requeued again: attempts + 1
        (R, Q, True),
        (R, S, True),
        (R, F, True),
        (R, R, False),
        (S, Q, False),
        (C, R, False),
        (F, S, False),
    ],
)
def test_the_transitions_table(current: JobStatus, to: JobStatus, allowed: bool) -> None:
    assert lifecycle.may_move(current, to) is allowed


def test_active_statuses_are_those_that_can_still_move() -> None:
    assert lifecycle.ACTIVE == (Q, R)
    assert lifecycle.allowed_from(S) == (Q, R)
    assert lifecycle.allowed_from(R) == (Q,)
    assert lifecycle.allowed_from(R) == lifecycle.HAND_OVER_FROM


def test_an_end_writes_the_terminal_record_from_any_active_status() -> None:
    move = lifecycle.end(new_job(), T, text="ab", finish_reason="time_limit", completion_tokens=2)
    assert move.allowed_from == (Q, R) and move.event is None and move.owner is None
    assert move.record.status == T and move.record.output.text == "ab"
    assert move.record.usage.completion_tokens == 2 and move.record.finished_at is not None
    with pytest.raises(AssertionError):
        lifecycle.end(new_job(), R, text="", finish_reason=None, completion_tokens=0)


def test_a_cancel_of_a_queued_job_only_applies_while_queued() -> None:
    move = lifecycle.cancel_queued(new_job())
    assert move.allowed_from == (Q,) and move.record.status == C
    assert move.record.output.finish_reason == "cancelled"


def test_a_cancel_of_an_orphaned_job_names_its_owner() -> None:
    job = new_job(status=R, owner="w:1:2")
    move = lifecycle.cancel_orphaned(job, "partial", 3)
    assert move.allowed_from == (R,) and move.owner == "w:1:2"
    assert move.record.output.text == "partial" and move.record.status == C


def test_a_requeue_starts_a_fresh_attempt() -> None:
    job = new_job(status=R, owner="w:1:2", attempts=1, runner_id="m@w", host="w")
    move = lifecycle.requeue(job)
    assert move.record.status == Q and move.record.attempts == 2
    assert move.record.runner_id is None and move.record.owner is None
    assert move.event == RequeuedEvent(attempt=2) and move.owner is None
    assert lifecycle.requeue(job, only_from_owner=True).owner == "w:1:2"


def test_a_start_marks_the_job_running_where_it_was_handed() -> None:
    started = lifecycle.start(new_job(), host="h", runner_id="m@h", owner="h:1:1")
    assert started.status == R and started.owner == "h:1:1" and started.started_at is not None
    assert started.runner_id == "m@h" and started.host == "h"


def test_what_a_delivery_finds() -> None:
    me = "h:1:1"
    assert lifecycle.on_delivery(None, me) is Delivery.UNKNOWN
    assert lifecycle.on_delivery(new_job(status=C), me) is Delivery.ENDED
    assert lifecycle.on_delivery(new_job(status=R, owner=me), me) is Delivery.REDELIVERED
    assert lifecycle.on_delivery(new_job(), me) is Delivery.START


def test_a_job_handed_over_at_its_submission_is_followed_by_its_holders_task_only() -> None:
    me = "h:1:1"
    direct = lifecycle.start(new_job(), host="h", runner_id="m@h", owner=me, direct=True)
    assert lifecycle.on_delivery(direct, me) is Delivery.FOLLOW
    # The worker that held it was restarted: a redelivery (its owner is judged, then requeued).
    assert lifecycle.on_delivery(direct, "h:1:2") is Delivery.REDELIVERED
    # Requeued, it is handed over by a task again, like any job.
    assert not lifecycle.requeue(direct).record.direct
    assert lifecycle.is_first_attempt(new_job())
    assert not lifecycle.is_first_attempt(new_job(attempts=1))


def test_endings_and_cancel_reasons() -> None:
    assert lifecycle.ending_event(new_job(status=F)) == "error"
    assert lifecycle.ending_event(new_job(status=S)) == "done"
    assert lifecycle.cancel_status("time_limit") == T
    assert lifecycle.cancel_status("cancelled") == C


@pytest.mark.parametrize(
    ("status", "restart", "down"),
    [
        (RunnerStatus.FAILED, None, True),
        (RunnerStatus.SHUTDOWN, None, True),
        (RunnerStatus.FAILED, utcnow(), False),  # a restart is coming
        (RunnerStatus.READY, None, False),
        (RunnerStatus.LOADING, None, False),
    ],
)
def test_a_runner_is_down_when_final_and_no_restart_is_coming(
    status: RunnerStatus, restart: object, down: bool
) -> None:
    state = RunnerState(id="m@h", host="h", model="m", status=status, next_restart_at=restart)
    assert state.is_down is down
