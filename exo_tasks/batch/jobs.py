"""A batch's lines as jobs: the job each line runs as, and cancelling those in flight. No HTTP
here, so the API and the feeder on a worker both use it."""

from __future__ import annotations

import contextlib

from celery import Celery

from exo_tasks import jobs
from exo_tasks.batch_types import Batch
from exo_tasks.errors import ExoError
from exo_tasks.store import Store


def line_job_id(batch_id: str, line: int) -> str:
    """The job a batch's line runs as: always the same, so a feeder that starts over on a line
    finds the job it sent before instead of sending another."""
    return f"{batch_id}-{line}"


def cancel_inflight(store: Store, celery: Celery, batch: Batch) -> None:
    """Cancel every job of the batch still running or queued (their runners keep the model)."""
    for line in store.batches.inflight(batch.id):
        with contextlib.suppress(ExoError):
            job_id = line_job_id(batch.id, line)
            jobs.cancel(store, job_id, jobs.CancelledBy.BATCH, celery=celery)
