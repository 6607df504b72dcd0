"""Celery's revoke, made a cancel for the tasks that run jobs.

Flower's Revoke and Terminate buttons, its `/api/task/revoke/<id>` and `celery control
revoke|terminate` all send Celery's `revoke` (or `terminate`) control command to every worker.
Celery's own handler only flags a running task (which runs on), and with `terminate` signals the
task's pool child: that kills the task, not the job, which its runner runs on to the end.

Here each worker, for a task id that names a job (the task id is the job id), cancels the job
through the job service as `POST /v1/jobs/<id>/cancel` does: a queued job never runs, a running
one ends at its runner's next step with its partial text, its model and its pool child spared.
The id is only flagged for Celery (a message not started yet is then dropped), whatever signal
was asked for. Any other id goes to Celery's revoke as sent. The task then ends `REVOKED`
(exo_tasks.worker.task_states). Every worker gets the command; cancelling is idempotent.

A job cancelled while queued (here, or by the API, which then sends this same revoke) has its
message withdrawn from its queue, by the one worker whose withdrawal finds it, and that worker
announces the task `REVOKED` at once. Celery would announce it only once some worker took the
message: up to a job's length later, or never if no live worker consumes that queue, and until
then Flower showed it `PENDING` and every queue count counted it as waiting."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import redis
from celery.utils.functional import maybe_list
from celery.worker import control as celery_control
from kombu.exceptions import KombuError

from exo_tasks import jobs
from exo_tasks.celery_app import ExoCelery
from exo_tasks.errors import ExoError, NotFound
from exo_tasks.types import JobStatus
from exo_tasks.worker import task_states

log = logging.getLogger("exo_tasks.revocation")
IDS = "[id1 [id2 [... [idN]]]]"
# Celery's own handler, which ours calls for what is not a job (not in celery-types' stubs).
celery_revoke: Callable[..., dict[str, Any]] = celery_control.revoke  # type: ignore[attr-defined]


def register() -> None:
    """Put these handlers in place of Celery's `revoke` and `terminate` (Celery's control panel
    is one per process)."""
    celery_control.control_command(name="revoke", variadic="task_id", signature=IDS)(revoke)
    celery_control.control_command(
        name="terminate", variadic="task_id", args=[("signal", str)], signature=f"<signal> {IDS}"
    )(terminate)


def revoke(
    state: Any, task_id: Any, terminate: bool = False, signal: str | None = None, **kwargs: Any
) -> dict[str, Any]:
    """Revoke tasks by id; for a task that runs a job, cancel the job (no signal is sent)."""
    task_ids = set(maybe_list(task_id) or [])
    app = cast(ExoCelery, state.app)
    cancelled = {id_ for id_ in task_ids if _cancel(app, id_, terminate, signal)}
    if cancelled:
        celery_revoke(state, sorted(cancelled))
    for job_id in sorted(cancelled):
        _withdraw(state, app, job_id)
    others = task_ids - cancelled
    if others:
        return celery_revoke(state, sorted(others), terminate, signal, **kwargs)
    return {"ok": f"jobs {', '.join(sorted(cancelled))} cancelled"}


def terminate(state: Any, signal: str, task_id: Any, **kwargs: Any) -> dict[str, Any]:
    """Terminate tasks by id; for a task that runs a job, cancel the job (no signal is sent)."""
    return revoke(state, task_id, terminate=True, signal=signal)


def _cancel(app: ExoCelery, job_id: str, terminate: bool, signal: str | None) -> bool:
    """Cancel the job `job_id` names; False if it names none."""
    extra = {"job_id": job_id, "terminate": terminate, "signal": signal}
    try:
        jobs.cancel(app.store, job_id, jobs.CancelledBy.REVOKE, celery=None)
    except NotFound:
        return False
    except (ExoError, redis.RedisError) as exc:
        # Ended already (409), or not known: in doubt, never signal a pool child for a job.
        log.info("revoke: job not cancelled", extra={**extra, "reason": str(exc)})
        return True
    log.info("revoke: job cancelled, no signal sent", extra=extra)
    return True


def _withdraw(state: Any, app: ExoCelery, job_id: str) -> None:
    """If the job was cancelled while queued and its message still waits, drop the message and
    announce its task REVOKED from this worker."""
    try:
        job = app.store.jobs.get(job_id)
        if job is None or job.status != JobStatus.CANCELLED or job.started_at is not None:
            return
        if not app.store.jobs.withdraw_message(job_id):
            return  # taken by a worker (which ends the task), or withdrawn by another
    except redis.RedisError as exc:
        log.warning("revoke: message not withdrawn", extra={"job_id": job_id, "error": str(exc)})
        return
    dispatcher = state.consumer.event_dispatcher

    def send(event: str, **fields: Any) -> None:
        try:
            dispatcher.send(event, uuid=job_id, **fields)
        except (redis.RedisError, KombuError) as exc:
            log.warning("task event not sent", extra={"event": event, "error": str(exc)})

    max_tokens = job.request.max_tokens
    task_states.announce_revoked(app.store, app.backend, job, max_tokens, send)
    log.info("revoke: queued job's message withdrawn", extra={"job_id": job_id})
