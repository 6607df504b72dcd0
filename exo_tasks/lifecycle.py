"""The job state machine: which status a job may move from, and the record and event each move
writes. Pure (no Redis, no MLX): the store executes a `Move` with one compare-and-set, so the
first of the runner, the task, the recovery loop or a cancel to move a job wins.

    queued ──hand-over──▶ running ──▶ succeeded | failed | cancelled | timed_out
      ▲                      │
      └──────requeue─────────┘   (its worker stopped or died: attempts + 1, `event: requeued`)
    queued ──▶ cancelled | timed_out | failed   (before any runner had it)
"""

from __future__ import annotations

from dataclasses import dataclass

from exo_tasks.types import (
    FinishReason,
    JobEvent,
    JobRecord,
    JobStatus,
    RequeuedEvent,
)

ACTIVE: tuple[JobStatus, ...] = ("queued", "running")


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
    final = job.finished(
        status,
        text=text,
        finish_reason=finish_reason,
        completion_tokens=completion_tokens,
        error=error,
    )
    return Move(final, ACTIVE)


def cancel_queued(job: JobRecord) -> Move:
    """A job no runner has taken: it ends at once and never runs."""
    final = job.finished("cancelled", text="", finish_reason="cancelled", completion_tokens=0)
    return Move(final, ("queued",))


def cancel_orphaned(job: JobRecord, text: str, completion_tokens: int) -> Move:
    """A running job whose worker is gone: nobody else can end it, so the cancel does."""
    final = job.finished(
        "cancelled", text=text, finish_reason="cancelled", completion_tokens=completion_tokens
    )
    return Move(final, ("running",), owner=job.owner)


def requeue(job: JobRecord, *, only_from_owner: bool = False) -> Move:
    """Back to `queued` for another attempt, its partial text dropped. `only_from_owner`: only
    while the attempt that `job` shows still holds it (the recovery loop must never take a job
    from an attempt that started since it looked)."""
    attempt = job.attempts + 1
    fresh = JobRecord(
        id=job.id,
        model=job.model,
        request=job.request,
        created_at=job.created_at,
        attempts=attempt,
    )
    return Move(
        fresh,
        ACTIVE,
        RequeuedEvent(attempt=attempt),
        owner=job.owner if only_from_owner else None,
    )
