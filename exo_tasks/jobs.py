"""The job service, with no HTTP in it: sending a job's Celery message and cancelling a job.
The API, the OpenAI routes and the recovery loop all go through here."""

from __future__ import annotations

from celery import Celery

from config.celery import PRIORITY_LEVELS
from config.settings import Settings
from exo_tasks import lifecycle, limits
from exo_tasks.celery_app import INFERENCE_TASK
from exo_tasks.errors import Conflict, NotFound
from exo_tasks.store import Store
from exo_tasks.types import CancelJob, JobRecord, JobStatus, host_queue, model_queue


def queue_of(job: JobRecord) -> str:
    """The queue a job waits in: its pinned host's own, or its model's (any host serving it)."""
    return host_queue(job.request.host) if job.request.host else model_queue(job.model)


def send(celery: Celery, settings: Settings, job: JobRecord) -> None:
    """Send the job's `inference` message, with its time limits and priority. The task id is
    the job id, so Celery's and Flower's views name the job."""
    job_limits = limits.job_limits(job.request.timeout_s, settings)
    celery.send_task(
        INFERENCE_TASK,
        args=[job.id, job.model],
        task_id=job.id,
        queue=queue_of(job),
        # Celery takes float seconds here; its stubs say int.
        soft_time_limit=job_limits.soft_s,  # type: ignore[arg-type]
        time_limit=job_limits.hard_s,  # type: ignore[arg-type]
        priority=PRIORITY_LEVELS[job.request.priority],
    )


def get_or_404(store: Store, job_id: str) -> JobRecord:
    job = store.get_job(job_id)
    if job is None:
        raise NotFound(f"no job '{job_id}'", {"job_id": job_id})
    return job


def cancel(store: Store, job_id: str) -> JobRecord:
    """Cancel a job, from the route or a streaming client that went away. A queued job ends
    `cancelled` at once and never runs; a running one is ended by its runner at the next step
    with its partial text (the runner keeps its model). A running job whose worker is gone is
    ended here, and a cancel is final: no later attempt of the job runs. Returns the job as
    it is now."""
    job = get_or_404(store, job_id)
    if not job.is_terminal:
        # First, so that an attempt that ends by requeue from now on ends cancelled instead.
        store.request_cancel(job_id)
        job = get_or_404(store, job_id)
    while job.status == JobStatus.QUEUED:
        move = lifecycle.cancel_queued(job)
        if store.apply(move):
            return move.record
        job = get_or_404(store, job_id)  # a runner took it meanwhile, or it ended
    if job.is_terminal:
        raise Conflict(f"job '{job_id}' is already {job.status}", {"status": job.status})
    assert job.runner_id is not None, "a running job always names its runner"
    if not store.owner_is_live(job):
        text, tokens = store.streamed_text(job_id)
        move = lifecycle.cancel_orphaned(job, text, tokens)
        if store.apply(move):
            return move.record
        return get_or_404(store, job_id)
    store.send_to_runner(job.runner_id, CancelJob(job_id=job_id, reason="cancelled"))
    return job
