"""The batch's state machine as data (OpenAI's Batch API): which status a batch may move to
from which. Pure: the store executes a `BatchMove` with one compare-and-set, so the feeder and
the API's cancel never overwrite each other. The job's and the runner's: exo_tasks.lifecycle.

    validating ─▶ in_progress ─▶ finalizing ─▶ completed
    validating | in_progress ─▶ cancelling ─▶ cancelled        in_progress ─▶ expired
    any not ended ─▶ failed      (its input does not validate, or a step of it raised)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from exo_tasks.batch.types import BATCH_ENDED, Batch, BatchStatus

log = logging.getLogger("exo_tasks.batches")
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


def move(batch: Batch, to: BatchStatus, at: int, **changes: Any) -> BatchMove:
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


def cancel(batch: Batch, at: int) -> BatchMove:
    """The API's cancel: from any status the table moves to `cancelling` from."""
    moved = batch.model_copy(update={"status": BS.CANCELLING, "cancelling_at": at})
    return BatchMove(moved, tuple(s for s, to in BATCH_TRANSITIONS.items() if BS.CANCELLING in to))
