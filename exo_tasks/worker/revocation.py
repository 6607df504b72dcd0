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
(exo_tasks.worker.task_states). Every worker gets the command; cancelling is idempotent."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import redis
from celery.utils.functional import maybe_list
from celery.worker import control as celery_control

from exo_tasks import jobs
from exo_tasks.celery_app import ExoCelery
from exo_tasks.errors import ExoError, NotFound

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
        jobs.cancel(app.store, job_id, jobs.CancelledBy.REVOKE)
    except NotFound:
        return False
    except (ExoError, redis.RedisError) as exc:
        # Ended already (409), or not known: in doubt, never signal a pool child for a job.
        log.info("revoke: job not cancelled", extra={**extra, "reason": str(exc)})
        return True
    log.info("revoke: job cancelled, no signal sent", extra=extra)
    return True
