"""OpenAI's Files API: upload a batch's input (multipart, `purpose: batch`), list, read,
download and delete files. Files live in Redis (exo_tasks.store.files), so every API process
and every host sees the same ones. Errors take OpenAI's shape (exo_tasks.api.errors)."""

from __future__ import annotations

import time
import uuid
from urllib.parse import quote

from flask import Blueprint, Response, jsonify, request
from werkzeug.exceptions import RequestEntityTooLarge

from exo_tasks.api.context import ctx
from exo_tasks.batch_types import FileDeleted, FileList, FileObject
from exo_tasks.errors import BadRequest, Conflict, ExoError, InvalidRequest, NotFound

bp = Blueprint("files", __name__, url_prefix="/v1")
# A multipart body holds the file and a little more: its part headers and the purpose field.
MULTIPART_SLACK_BYTES = 64 << 10
MAX_PAGE = 10_000


class FileTooLarge(ExoError):
    status = 413
    type = "file_too_large"


@bp.post("/files")
def upload() -> Response:
    ctx().refuse_if_storage_low()
    settings = ctx().settings
    limit = settings.batch_max_file_bytes
    too_large = FileTooLarge(
        f"the file is larger than {limit} bytes (EXO_BATCH_MAX_FILE_BYTES)", {"field": "file"}
    )
    # This route's own cap, instead of EXO_MAX_BODY_BYTES (werkzeug reads chunked bodies to it).
    request.max_content_length = limit + MULTIPART_SLACK_BYTES
    try:
        purpose, upload = request.form.get("purpose"), request.files.get("file")
    except RequestEntityTooLarge:
        raise too_large from None
    if purpose != "batch":
        raise InvalidRequest("purpose must be 'batch'", {"field": "purpose"})
    if upload is None:
        raise InvalidRequest("a multipart part 'file' is required", {"field": "file"})
    data = upload.read(limit + 1)
    if len(data) > limit:
        raise too_large
    meta = FileObject(
        id=f"file-{uuid.uuid4().hex}",
        bytes=len(data),
        created_at=int(time.time()),
        filename=upload.filename or "file.jsonl",
        purpose="batch",
    )
    ctx().store.files.put(meta, _text(data, settings.batch_max_lines))
    ctx().replicate("a file", file_id=meta.id)
    return jsonify(meta.model_dump(mode="json"))


def _text(data: bytes, max_lines: int) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("the file must be UTF-8 text (JSONL)", {"field": "file"}) from None
    lines = sum(1 for line in text.split("\n") if line.strip())
    if lines > max_lines:
        message = f"the file holds {lines} requests, more than {max_lines} (EXO_BATCH_MAX_LINES)"
        raise InvalidRequest(message, {"field": "file"})
    return text


@bp.get("/files")
def list_files() -> Response:
    after, limit = page_args(MAX_PAGE, MAX_PAGE)
    page = ctx().store.files.page(after, limit)
    if page is None:
        raise NotFound(f"no file '{after}'", {"field": "after"})
    files, more = page
    first, last = (files[0].id, files[-1].id) if files else (None, None)
    listed = FileList(data=files, first_id=first, last_id=last, has_more=more)
    return jsonify(listed.model_dump(mode="json"))


@bp.get("/files/<file_id>")
def get_file(file_id: str) -> Response:
    return jsonify(_file_or_404(file_id).model_dump(mode="json"))


@bp.get("/files/<file_id>/content")
def file_content(file_id: str) -> Response:
    meta = _file_or_404(file_id)
    content = ctx().store.files.content(file_id)
    if content is None:  # deleted meanwhile
        raise NotFound(f"no file '{file_id}'", {"field": "file_id"})
    headers = {"Content-Disposition": content_disposition(meta.filename)}
    return Response(content, mimetype="application/octet-stream", headers=headers)


def content_disposition(filename: str) -> str:
    """RFC 6266: the name as `filename*=UTF-8''…` (percent-encoded), and for old clients an
    ASCII `filename` with `_` for anything else and for quotes, backslashes and controls. A
    header must be Latin-1 (gunicorn answered 500 for `日本語.jsonl`), and a `"` in the name
    ended the value and added parameters of the client's choosing."""
    fallback = "".join(c if " " <= c <= "~" and c not in '"\\' else "_" for c in filename)
    encoded = quote(filename, safe="", errors="replace")
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{encoded}"


@bp.delete("/files/<file_id>")
def delete_file(file_id: str) -> Response:
    """409 while a batch reads the file (the feeder fails a batch whose input goes anyway)."""
    store = ctx().store
    batch = store.batches.open_reading(file_id)
    if batch is not None:
        message = (
            f"file '{file_id}' is the input of batch '{batch.id}', which is {batch.status}: "
            "delete it once the batch has ended (or cancel the batch)"
        )
        raise Conflict(message, {"field": "file_id", "batch_id": batch.id})
    if not store.files.delete(file_id):
        raise NotFound(f"no file '{file_id}'", {"field": "file_id"})
    return jsonify(FileDeleted(id=file_id).model_dump(mode="json"))


def _file_or_404(file_id: str) -> FileObject:
    meta = ctx().store.files.get(file_id)
    if meta is None:
        raise NotFound(f"no file '{file_id}'", {"field": "file_id"})
    return meta


def page_args(default: int, maximum: int) -> tuple[str | None, int]:
    """`after` (the last id of the previous page) and `limit`, as OpenAI's list routes take
    them."""
    raw = request.args.get("limit", str(default))
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= maximum:
        raise BadRequest(f"limit must be an integer from 1 to {maximum}", {"field": "limit"})
    return request.args.get("after") or None, int(raw)
