"""Celery tasks, run in the worker's pool children. They never import MLX: they hand work to
the host's runner through Redis and wait for its result, in short slices so that Celery's soft
time limit (a signal) is delivered promptly."""

from __future__ import annotations

import logging
import time
from typing import Any, cast

from celery import Task, shared_task
from celery.exceptions import SoftTimeLimitExceeded

from exo_tasks.celery_app import INFERENCE_TASK, ExoCelery
from exo_tasks.errors import ExoError, RunnerGone
from exo_tasks.store import Store
from exo_tasks.types import (
    CancelJob,
    DoneEvent,
    JobRecord,
    RunnerState,
    SubmitJob,
    runner_id_for,
)

log = logging.getLogger("exo_tasks.tasks")
WAIT_SLICE_MS = 500
# After a soft time limit the runner ends the job at its next step; this bounds our wait.
CANCEL_ACK_S = 3.0


def _app(task: Task[Any, Any]) -> ExoCelery:
    return cast(ExoCelery, task.app)


@shared_task(name=INFERENCE_TASK, bind=True)
def inference(self: Task[Any, Any], job_id: str) -> dict[str, Any]:
    """Run one job on this host's runner for its model; the job record holds the result."""
    app = _app(self)
    store, settings = app.store, app.settings
    job = store.get_job(job_id)
    if job is None:
        log.warning("job unknown or expired; skipped", extra={"job_id": job_id})
        return {"job_id": job_id, "status": "unknown"}
    if job.is_terminal:  # cancelled while queued, or finished by an earlier delivery
        return _summary(job)
    runner_id = runner_id_for(job.model, settings.hostname)
    extra = {"job_id": job_id, "runner": runner_id}
    try:
        runner = _await_runner(store, runner_id, settings.runner_start_timeout_s)
        hard_limit = (self.request.timelimit or (None, None))[0] or settings.job_hard_time_limit_s
        store.send_to_runner(runner_id, SubmitJob(job_id=job_id, deadline=time.time() + hard_limit))
        log.info("job handed to runner", extra=extra)
        try:
            return _summary(_follow(store, job_id, runner, until=None))
        except SoftTimeLimitExceeded:
            log.warning("soft time limit reached; ending the job", extra=extra)
            store.send_to_runner(runner_id, CancelJob(job_id=job_id, reason="time_limit"))
            return _summary(_follow(store, job_id, runner, until=time.monotonic() + CANCEL_ACK_S))
    except ExoError as exc:
        store.fail_job(job_id, exc.message)
        log.error("job failed", extra={**extra, "error": exc.message})
        raise


def _await_runner(store: Store, runner_id: str, timeout_s: float) -> RunnerState:
    """The runner once it takes jobs; a runner still loading is waited for, in slices."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = store.get_runner(runner_id)
        if state is not None and state.status.accepts_jobs:
            return state
        if state is not None and state.status.is_final and state.next_restart_at is None:
            raise RunnerGone(f"runner {runner_id} is {state.status}: {state.error or 'stopped'}")
        if time.monotonic() > deadline:
            raise RunnerGone(f"runner {runner_id} not ready after {timeout_s:.0f}s")
        time.sleep(0.1)


def _follow(store: Store, job_id: str, runner: RunnerState, until: float | None) -> JobRecord:
    """Wait for the job's last event. Returns the final record; never waits on a dead runner."""
    after = "0-0"
    while True:
        for event_id, event in store.read_events(job_id, after, block_ms=WAIT_SLICE_MS):
            after = event_id
            if isinstance(event, DoneEvent):
                return event.job
        current = store.get_runner(runner.id)
        if current is None or current.pid != runner.pid or current.status.is_final:
            store.fail_job(job_id, f"runner {runner.id} stopped while running the job")
        if until is not None and time.monotonic() > until:
            _time_out(store, job_id)
        job = store.get_job(job_id)
        if job is not None and job.is_terminal:
            return job


def _time_out(store: Store, job_id: str) -> None:
    """The runner did not end the job after the soft limit: record it as timed out ourselves."""
    job = store.get_job(job_id)
    if job is None or job.is_terminal:
        return
    text, tokens = store.streamed_text(job_id)
    store.finish_job(
        job.finished("timed_out", text=text, finish_reason="time_limit", completion_tokens=tokens)
    )


def _summary(job: JobRecord) -> dict[str, Any]:
    return {"job_id": job.id, "status": job.status, "finish_reason": job.output.finish_reason}
