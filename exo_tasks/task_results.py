"""An inference task's SUCCESS, as Celery's result backend and Flower hold it: stored by the
task as its job ends (exo_tasks.worker.task_states), or, for a job handed over directly that
succeeded before its task was due (exo_tasks.direct), stored and announced without a message."""

from __future__ import annotations

import logging
from typing import Any

import redis
from celery import states
from celery.utils.saferepr import saferepr
from kombu.exceptions import KombuError

from exo_tasks.celery_app import INFERENCE_TASK, ExoCelery
from exo_tasks.naming import node_name
from exo_tasks.types import JobEnding, JobRecord

log = logging.getLogger("exo_tasks.tasks")


def succeeded(job: JobEnding) -> dict[str, Any]:
    """The task's result for its succeeded job."""
    return {
        "job_id": job.id,
        "status": job.status,
        "finish_reason": job.output.finish_reason,
        "tokens": job.usage.completion_tokens,
        "runner": job.runner_id,
    }


def announce_succeeded(celery: ExoCelery, job: JobRecord, queue: str) -> None:
    """Store the task of a succeeded job SUCCESS, and send the events that sending it to
    `queue` and its host's worker running it would have sent (sent, received, started,
    succeeded, at the job's own times, their values as Celery writes them), so that Flower
    shows it as any task, sent by this process and run by that worker: as a best effort, as
    the task's own events."""
    result = succeeded(job)
    created = job.created_at.timestamp()
    started = (job.started_at or job.created_at).timestamp()
    ended = (job.finished_at or job.created_at).timestamp()
    task = {
        "uuid": job.id,
        "name": INFERENCE_TASK,
        "args": saferepr([job.id, job.model]),
        "kwargs": "{}",
        "root_id": job.id,
        "parent_id": None,
        "retries": 0,
        "eta": None,
        "expires": None,
    }
    extra = {"job_id": job.id, "runner": job.runner_id}
    try:
        celery.backend.store_result(job.id, result, states.SUCCESS)
        with celery.events.default_dispatcher(hostname=node_name(job.host or "")) as events:
            route = {"queue": queue, "exchange": queue, "routing_key": queue}
            celery.send_sent_event(events.producer, **task, **route, timestamp=created)
            events.send("task-received", **task, timestamp=started)
            events.send("task-started", uuid=job.id, timestamp=started)
            events.send(
                "task-succeeded",
                uuid=job.id,
                result=saferepr(result),
                runtime=ended - started,
                timestamp=ended,
            )
    except (redis.RedisError, KombuError) as exc:
        log.warning("direct job's success not announced", extra={**extra, "error": str(exc)})
        return
    log.info("direct job succeeded before its task was due; announced", extra=extra)
