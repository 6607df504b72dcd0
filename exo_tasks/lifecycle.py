"""The state machines as data: which status a job, a runner or a batch may move to from which
(an instance's: exo_tasks.instances).

The job's: the record and event each move writes. Pure (no Redis, no MLX): the store executes a
`Move` with one compare-and-set, so the first of the runner, the task, the recovery loop or a
cancel to move a job wins.

    queued ──hand-over──▶ running ──▶ succeeded | failed | cancelled | timed_out
      ▲                      │
      └──────requeue─────────┘   (its worker stopped or died: attempts + 1, `event: requeued`)
    queued ──▶ cancelled | timed_out | failed   (before any runner had it)

The hand-over is its task's, or the API's as the job is submitted (exo_tasks.direct).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Literal

from exo_tasks.batch_types import BATCH_ENDED, Batch, BatchStatus
from exo_tasks.fleet_types import RunnerState, RunnerStatus
from exo_tasks.types import (
    FinishReason,
    JobEvent,
    JobRecord,
    JobStatus,
    RequeuedEvent,
    utcnow,
)

log = logging.getLogger("exo_tasks.lifecycle")
QUEUED, RUNNING = JobStatus.QUEUED, JobStatus.RUNNING
ENDINGS = frozenset(s for s in JobStatus if s.is_terminal)

# Every move a job may make: status → the statuses it may move to. An ending has none.
TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    # Handed over; ended before any runner had it; requeued again (attempts + 1).
    QUEUED: frozenset({RUNNING, QUEUED, *ENDINGS}),
    # Ended by its runner, its task, a cancel or the recovery loop; requeued.
    RUNNING: frozenset({QUEUED, *ENDINGS}),
    **{ending: frozenset() for ending in ENDINGS},
}
ACTIVE: tuple[JobStatus, ...] = tuple(s for s, to in TRANSITIONS.items() if to)


def may_move(current: JobStatus, to: JobStatus) -> bool:
    return to in TRANSITIONS[current]


def allowed_from(to: JobStatus) -> tuple[JobStatus, ...]:
    """The statuses from which a job may move to `to`, in the table's order."""
    return tuple(s for s, targets in TRANSITIONS.items() if to in targets)


@dataclass(frozen=True)
class Move:
    """Write `record` if the stored job is in one of `allowed_from` (and, when `owner` is set,
    still held by that worker incarnation), appending `event` to its stream. A terminal record
    appends its `done`/`error` event instead."""

    record: JobRecord
    allowed_from: tuple[JobStatus, ...]
    event: JobEvent | None = None
    owner: str | None = None


def end(
    job: JobRecord,
    status: JobStatus,
    *,
    text: str,
    finish_reason: FinishReason | None,
    completion_tokens: int,
    error: str | None = None,
) -> Move:
    """Any active job to a terminal status."""
    assert status in ENDINGS, status
    final = job.ended(
        status,
        text=text,
        finish_reason=finish_reason,
        completion_tokens=completion_tokens,
        error=error,
    )
    return Move(final, allowed_from(status))


def write_ending(job: JobRecord) -> Move:
    """A record its runner already ended (`JobRecord.ended`), written if still active."""
    return Move(job, allowed_from(job.status))


def cancel_queued(job: JobRecord) -> Move:
    """A job no runner has taken: it ends at once and never runs."""
    final = job.ended(JobStatus.CANCELLED, text="", finish_reason="cancelled", completion_tokens=0)
    return Move(final, (QUEUED,))


def cancel_orphaned(job: JobRecord, text: str, completion_tokens: int) -> Move:
    """A running job whose worker is gone: nobody else can end it, so the cancel does."""
    final = job.ended(
        JobStatus.CANCELLED,
        text=text,
        finish_reason="cancelled",
        completion_tokens=completion_tokens,
    )
    return Move(final, (RUNNING,), owner=job.owner)


def requeue(job: JobRecord, *, only_from_owner: bool = False) -> Move:
    """Back to `queued` for another attempt, its partial text dropped. `only_from_owner`: only
    while the attempt that `job` shows still holds it (the recovery loop must never take a job
    from an attempt that started since it looked)."""
    attempt = job.attempts + 1
    fresh = JobRecord(
        id=job.id,
        model=job.model,
        request=job.request,
        instance=job.instance,
        created_at=job.created_at,
        attempts=attempt,
    )
    return Move(
        fresh,
        allowed_from(QUEUED),
        RequeuedEvent(attempt=attempt),
        owner=job.owner if only_from_owner else None,
    )


# --- the hand-over, which the store executes with the runner's inbox in one script ---

HAND_OVER_FROM: tuple[JobStatus, ...] = (QUEUED,)


def start(
    job: JobRecord, *, host: str, runner_id: str, owner: str, direct: bool = False
) -> JobRecord:
    """The job as it is handed to a runner: running there, held by `owner`. Whether it may
    still move (from HAND_OVER_FROM) is the store's compare-and-set to decide. `direct`: handed
    over as it was submitted, by the API (exo_tasks.direct), not by its task."""
    update = {
        "status": RUNNING,
        "started_at": utcnow(),
        "host": host,
        "runner_id": runner_id,
        "owner": owner,
        "direct": direct,
    }
    return job.model_copy(update=update)


# --- what a delivered `inference` message finds ---


class Delivery(enum.Enum):
    """What a task does with the job its message names."""

    UNKNOWN = "unknown"  # expired, or never recorded
    ENDED = "ended"  # cancelled while queued, or finished by an earlier delivery
    REDELIVERED = "redelivered"  # running: a duplicate, or its worker died
    FOLLOW = "follow"  # running: handed over as it was submitted, held by this very worker
    START = "start"


def on_delivery(job: JobRecord | None, incarnation: str) -> Delivery:
    """What the worker incarnation `incarnation` does with the job its message names."""
    if job is None:
        return Delivery.UNKNOWN
    if job.is_terminal:
        return Delivery.ENDED
    if job.status == RUNNING:
        direct = job.direct and job.owner == incarnation
        return Delivery.FOLLOW if direct else Delivery.REDELIVERED
    return Delivery.START


def is_first_attempt(job: JobRecord) -> bool:
    """A queued job never handed over: no ending and no events in its streams yet."""
    return job.status == QUEUED and job.attempts == 0


def ending_event(job: JobRecord) -> Literal["done", "error"]:
    """The last event of an ended job's stream: `error` for a failure."""
    return "error" if job.status == JobStatus.FAILED else "done"


def cancel_status(reason: Literal["cancelled", "time_limit"]) -> JobStatus:
    """How a job a runner is told to drop ends: a time limit is `timed_out`."""
    return JobStatus.TIMED_OUT if reason == "time_limit" else JobStatus.CANCELLED


# --- the runner: one life per process, from its spawn to its process's end ---
#
#   WaitingForModel ─▶ Loading ─▶ Loaded ─▶ WarmingUp ─▶ Ready ⇄ Running
#   Ready | Running ─▶ ShuttingDown ─▶ Shutdown      Ready ─▶ Unloaded (idle)
#   any ─▶ Failed      (a crash, a hang, its host gone: its supervisor or the recovery loop says so)
#   any ─▶ Shutdown    (stopped on purpose: its supervisor says so once the process has ended,
#                       however it ended; the escalation's cause, if it took one, is its error)
#
# A spawn begins a new life (`spawned_runner`), whatever the last one left in Redis.

RS = RunnerStatus
# Its process has ended (or is ending): only the supervisor or the recovery loop speaks for it
# now, and only a spawn brings it back.
RUNNER_ENDINGS = frozenset({RS.UNLOADED, RS.SHUTDOWN, RS.FAILED})
ENDED_BY_ITS_SUPERVISOR = frozenset({RS.SHUTDOWN, RS.FAILED})
RUNNER_TRANSITIONS: dict[RunnerStatus, frozenset[RunnerStatus]] = {
    RS.WAITING_FOR_MODEL: frozenset({RS.LOADING, *ENDED_BY_ITS_SUPERVISOR}),
    RS.LOADING: frozenset({RS.LOADED, *ENDED_BY_ITS_SUPERVISOR}),
    RS.LOADED: frozenset({RS.WARMING_UP, *ENDED_BY_ITS_SUPERVISOR}),
    RS.WARMING_UP: frozenset({RS.READY, *ENDED_BY_ITS_SUPERVISOR}),
    RS.READY: frozenset({RS.RUNNING, RS.SHUTTING_DOWN, RS.UNLOADED, *ENDED_BY_ITS_SUPERVISOR}),
    RS.RUNNING: frozenset({RS.READY, RS.SHUTTING_DOWN, *ENDED_BY_ITS_SUPERVISOR}),
    RS.SHUTTING_DOWN: ENDED_BY_ITS_SUPERVISOR,
    # Stopped on purpose while unloaded; or its host went, or it crashed as it unloaded.
    RS.UNLOADED: ENDED_BY_ITS_SUPERVISOR,
    # It said Shutdown, then its process failed after all (a hang its supervisor stopped).
    RS.SHUTDOWN: frozenset({RS.FAILED}),
    # Stopped on purpose while it waited for its restart.
    RS.FAILED: frozenset({RS.SHUTDOWN}),
}
RUNNER_BORN = RS.WAITING_FOR_MODEL


def spawned_runner(runner_id: str, host: str, model: str, **fields: Any) -> RunnerState:
    """A runner's record as its process is spawned: a new life."""
    return RunnerState(id=runner_id, host=host, model=model, status=RUNNER_BORN, **fields)


def may_move_runner(current: RunnerStatus, to: RunnerStatus) -> bool:
    """Whether the table allows it; publishing the status a runner has is no move."""
    return to == current or to in RUNNER_TRANSITIONS[current]


def move_runner(state: RunnerState, to: RunnerStatus, **changes: Any) -> RunnerState | None:
    """`state` moved to `to`, with `changes`; None if the table has no such move, logged (the
    writer goes on: a wrong status is no reason to crash a runner or its supervisor)."""
    if not may_move_runner(state.status, to):
        log.error(
            "runner status change refused",
            extra={"runner": state.id, "host": state.host, "status": state.status, "to": to},
        )
        return None
    return state.model_copy(update={**changes, "status": to})


# --- the batch (OpenAI's Batch API) ---
#
#   validating ─▶ in_progress ─▶ finalizing ─▶ completed
#   validating | in_progress ─▶ cancelling ─▶ cancelled        in_progress ─▶ expired
#   any not ended ─▶ failed      (its input does not validate, or a step of it raised)

BS = BatchStatus
BATCH_TRANSITIONS: dict[BatchStatus, frozenset[BatchStatus]] = {
    BS.VALIDATING: frozenset({BS.IN_PROGRESS, BS.CANCELLING, BS.FAILED}),
    BS.IN_PROGRESS: frozenset({BS.FINALIZING, BS.EXPIRED, BS.CANCELLING, BS.FAILED}),
    BS.FINALIZING: frozenset({BS.COMPLETED, BS.FAILED}),
    BS.CANCELLING: frozenset({BS.CANCELLED, BS.FAILED}),
    # An ending closed again: a feeder killed between the move and dropping what the batch
    # kept leaves it open, and the next feeder closes it once more.
    **{ending: frozenset({ending}) for ending in BATCH_ENDED},
}


@dataclass(frozen=True)
class BatchMove:
    """Write `batch` if the stored one is in one of `allowed_from` (compare-and-set: the API's
    cancel and the feeder never overwrite each other). None allowed: a move the table refused."""

    batch: Batch
    allowed_from: tuple[BatchStatus, ...]


def move_batch(batch: Batch, to: BatchStatus, at: int, **changes: Any) -> BatchMove:
    """The feeder's move of `batch` to `to` at `at` (its `<to>_at`), with `changes`: only from
    the status it saw, so a cancel that came meanwhile is never overwritten."""
    moved = batch.model_copy(update={**changes, "status": to, f"{to}_at": at})
    if to in BATCH_TRANSITIONS[batch.status]:
        return BatchMove(moved, (batch.status,))
    log.error(
        "batch status change refused",
        extra={"batch_id": batch.id, "status": batch.status, "to": to},
    )
    return BatchMove(moved, ())


def cancel_batch(batch: Batch, at: int) -> BatchMove:
    """The API's cancel: from any status the table moves to `cancelling` from."""
    moved = batch.model_copy(update={"status": BS.CANCELLING, "cancelling_at": at})
    return BatchMove(moved, tuple(s for s, to in BATCH_TRANSITIONS.items() if BS.CANCELLING in to))
