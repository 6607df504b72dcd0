"""OpenAI's Batch API: create a batch from an uploaded file, read it, list batches, cancel one.
The API only records the batch; the feeder on a worker drives it (exo_tasks.batch.feeder)."""

from __future__ import annotations

import time
import uuid

from flask import Blueprint, Response, jsonify

from exo_tasks import lifecycle
from exo_tasks.api.context import ctx
from exo_tasks.api.files import page_args
from exo_tasks.api.http import json_body
from exo_tasks.batch.jobs import cancel_inflight
from exo_tasks.batch_types import Batch, BatchCreate, BatchList, BatchStatus, window_seconds
from exo_tasks.errors import Conflict, InvalidRequest, NotFound

bp = Blueprint("batches", __name__, url_prefix="/v1")
MAX_PAGE = 100


@bp.post("/batches")
def create_batch() -> Response:
    body = BatchCreate.model_validate(json_body())
    ctx().refuse_if_storage_low()
    store = ctx().store
    input_file = store.files.get(body.input_file_id)
    if input_file is None:
        raise NotFound(f"no file '{body.input_file_id}'", {"field": "input_file_id"})
    if input_file.purpose != "batch":
        message = f"file '{input_file.id}' has purpose '{input_file.purpose}', not 'batch'"
        raise InvalidRequest(message, {"field": "input_file_id"})
    now = int(time.time())
    batch = Batch(
        id=f"batch_{uuid.uuid4().hex}",
        endpoint=body.endpoint,
        input_file_id=body.input_file_id,
        completion_window=body.completion_window,
        created_at=now,
        expires_at=now + window_seconds(body.completion_window),
        metadata=body.metadata,
    )
    store.batches.create(batch)
    ctx().replicate("a batch", batch_id=batch.id)
    return jsonify(batch.model_dump(mode="json"))


@bp.get("/batches/<batch_id>")
def get_batch(batch_id: str) -> Response:
    return jsonify(_batch_or_404(batch_id).model_dump(mode="json"))


@bp.get("/batches")
def list_batches() -> Response:
    after, limit = page_args(20, MAX_PAGE)
    page = ctx().store.batches.page(after, limit)
    if page is None:
        raise NotFound(f"no batch '{after}'", {"field": "after"})
    batches, more = page
    first, last = (batches[0].id, batches[-1].id) if batches else (None, None)
    listed = BatchList(data=batches, first_id=first, last_id=last, has_more=more)
    return jsonify(listed.model_dump(mode="json"))


@bp.post("/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str) -> Response:
    """Stop feeding at once and cancel the jobs in flight; the feeder then ends the batch
    `cancelled`, with the lines that finished in its output file."""
    context = ctx()
    batch = _batch_or_404(batch_id)
    if batch.ended:
        raise Conflict(f"batch '{batch_id}' is already {batch.status}", {"status": batch.status})
    if batch.status != BatchStatus.CANCELLING:
        if not context.store.batches.move(lifecycle.cancel_batch(batch, int(time.time()))):
            batch = _batch_or_404(batch_id)
            if batch.status != BatchStatus.CANCELLING:
                raise Conflict(f"batch '{batch_id}' is {batch.status}", {"status": batch.status})
        cancel_inflight(context.store, context.celery, batch)
    return jsonify(_batch_or_404(batch_id).model_dump(mode="json"))


def _batch_or_404(batch_id: str) -> Batch:
    batch = ctx().store.batches.get(batch_id)
    if batch is None:
        raise NotFound(f"no batch '{batch_id}'", {"field": "batch_id"})
    return batch
