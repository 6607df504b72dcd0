"""How an inference task shows in Celery's result backend and in Flower: `STARTED` while its job
runs (with the job's progress), then its job's own ending: `SUCCESS` for a succeeded job,
`REVOKED` for a cancelled one, `FAILURE` naming the reason for a failed or timed-out one.

Flower takes a task's state from events, and a custom state (such as `PROGRESS`) outranks
`REVOKED` in Celery's event merge, hides the task from Flower's "Started" filter and takes
away its Terminate button: progress is reported as `STARTED`."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Task, states
from celery.exceptions import Ignore
from kombu.exceptions import KombuError

from exo_tasks import task_results
from exo_tasks.celery_app import exo_app
from exo_tasks.store import Store
from exo_tasks.types import JobEnding, JobRecord, JobStatus
from exo_tasks.worker import soft_limit

log = logging.getLogger("exo_tasks.tasks")
# A report is a result-backend write and an event: per token at 32 jobs it cost the runner's
# CPU (a pool child per job); Flower needs no more than this.
PROGRESS_EVERY_S = 2.0


class JobEnded(Exception):
    """The task's FAILURE: its job ended `failed` or `timed_out` (the message says why). No
    ExoError on purpose: the task fails its job on an ExoError, and this job has ended."""


class TaskProgress:
    """A job's tokens so far, as its task's `STARTED` state (meta `tokens`, `max_tokens` and
    the `runner` that runs it: Flower names only the worker) for result readers and a
    `task-started` event carrying it as `result` for Flower, as a best effort. The tokens are
    the events in the job's stream since the attempt began.

    The first report comes with the task's first check on its job, a wait slice after the
    hand-over, then at most every PROGRESS_EVERY_S: a job that ends within a slice (most short
    ones) goes from `PENDING` to its ending with no write of this kind, where a `STARTED` stored
    at the hand-over cost two round trips while its runner computed the first token."""

    def __init__(
        self, task: Task[Any, Any], max_tokens: int, events_before: int, runner: str
    ) -> None:
        self.task = task
        self.max_tokens = max_tokens
        self.events_before = events_before
        self.runner = runner
        self.tokens = 0
        self.reported = False
        # The event would otherwise move Flower's "started" time to each report's.
        self.started_at = time.time()
        self.reported_at = time.monotonic()

    def update(self, events: int) -> None:
        tokens = events - self.events_before
        now = time.monotonic()
        if self.reported and (tokens == self.tokens or now - self.reported_at < PROGRESS_EVERY_S):
            return
        self.tokens, self.reported_at = tokens, now
        meta = {"tokens": tokens, "max_tokens": self.max_tokens, "runner": self.runner}
        if self._store(meta):
            self.reported = True
            # Flower shows a task's `result` as a repr, as in task-succeeded events.
            _send(self.task, "task-started", result=repr(meta), started=self.started_at)

    def _store(self, meta: dict[str, Any]) -> bool:
        try:
            self.task.update_state(state=states.STARTED, meta=meta)
            return True
        except (redis.RedisError, KombuError) as exc:
            log.warning("progress not reported", extra={"error": str(exc)})
            return False


def finish(
    task: Task[Any, Any], job_id: str, job: JobEnding | None, max_tokens: int | None = None
) -> dict[str, Any]:
    """End the task as its job ended. A succeeded job (or an unknown one) is the task's result;
    a cancelled one makes the task `REVOKED` with its final tokens and who cancelled it (stored
    and announced here, then the task is ignored so that Celery stores nothing over it); a
    failed or timed-out one raises JobEnded, the task's FAILURE. A job still running (a
    duplicate message, while another attempt runs it) leaves the task's state to that attempt.
    `max_tokens`: the job's, when `job` is an ending without its request."""
    soft_limit.decided()
    if job is None:  # unknown, or expired
        return {"job_id": job_id, "status": "unknown"}
    if isinstance(job, JobRecord):
        max_tokens = job.request.max_tokens
    if job.status == JobStatus.CANCELLED:
        _revoked(task, job, max_tokens)
        raise Ignore()
    if job.status in (JobStatus.FAILED, JobStatus.TIMED_OUT):
        # Not chained to what was being handled (a soft limit cuts a Redis read anywhere):
        # the recorded traceback is this one, a few lines that name the reason.
        raise JobEnded(_failure(task, job)) from None
    if not job.is_terminal:
        raise Ignore()
    return task_results.succeeded(job)


def _failure(task: Task[Any, Any], job: JobEnding) -> str:
    """Why a job failed; for a time limit, which one and how many seconds."""
    on = f" on runner {job.runner_id}" if job.runner_id else ""
    if job.output.finish_reason != "time_limit":
        return f"job {job.status}{on}: {job.error}"
    hard_s, soft_s = task.request.timelimit or (None, None)
    if job.status == JobStatus.TIMED_OUT:
        return (
            f"job timed_out{on}: its soft time limit{_seconds(soft_s)} was reached (the job's "
            "timeout_s, else EXO_JOB_SOFT_TIME_LIMIT_S); the text so far is kept"
        )
    return (
        f"job failed{on}: its hard time limit{_seconds(hard_s)} was reached (the soft limit + "
        "EXO_JOB_HARD_GRACE_S)"
    )


def _seconds(limit_s: float | None) -> str:
    return f" of {limit_s:g}s" if limit_s else ""


def _revoked(task: Task[Any, Any], job: JobEnding, max_tokens: int | None) -> None:
    store = exo_app(task).store
    send = functools.partial(_send, task)
    announce_revoked(store, task.backend, job, max_tokens, send, request=task.request)


def announce_revoked(
    store: Store,
    backend: Any,
    job: JobEnding,
    max_tokens: int | None,
    send: Callable[..., None],
    request: Any = None,
) -> None:
    """Store the task REVOKED and `send` its `task-revoked` event, with the job's final tokens,
    its runner and who cancelled it: the last progress report (a `task-started` event) would
    otherwise stay the task's result in Flower. By the task that ends, or by the worker that
    withdrew the message of a job cancelled while queued (exo_tasks.worker.revocation)."""
    reason = _cancel_reason(store, job)
    tokens = job.usage.completion_tokens
    try:
        backend.mark_as_revoked(job.id, f"{reason} ({tokens} tokens)", request=request)
    except (redis.RedisError, KombuError) as exc:
        log.warning("revoked state not stored", extra={"job_id": job.id, "error": str(exc)})
    ended = {"tokens": tokens, "max_tokens": max_tokens, "runner": job.runner_id, "reason": reason}
    send("task-revoked", terminated=False, signum=None, expired=False, result=repr(ended))


def _cancel_reason(store: Store, job: JobEnding) -> str:
    """Who cancelled the job (exo_tasks.jobs.CancelledBy), else how its runner ended it."""
    try:
        reason = store.jobs.cancel_reason(job.id)
    except redis.RedisError:
        reason = None
    return reason or f"cancelled ({job.output.finish_reason})"


def _send(task: Task[Any, Any], event: str, **fields: Any) -> None:
    try:
        task.send_event(event, retry=False, **fields)
    except (redis.RedisError, KombuError) as exc:
        log.warning("task event not sent", extra={"event": event, "error": str(exc)})
