"""OpenAI's Files and Batch API in /openapi.json (exo_tasks.api.files, exo_tasks.api.batches)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from exo_tasks.api.openapi_ops import Op, Reply
from exo_tasks.batch_types import Batch, BatchCreate, BatchList, FileDeleted, FileList, FileObject


class FileUpload(BaseModel):
    """Body of POST /v1/files (multipart/form-data): the JSONL file and its purpose."""

    file: bytes = Field(json_schema_extra={"format": "binary"})
    purpose: str = Field(json_schema_extra={"enum": ["batch"]})


def _page(maximum: int) -> dict[str, dict[str, Any]]:
    return {
        "after": {"type": "string", "description": "The last id of the previous page"},
        "limit": {"type": "integer", "minimum": 1, "maximum": maximum},
    }


def _op(method: str, path: str, summary: str, reply: Reply, **fields: Any) -> Op:
    return Op(method, path, summary, {200: reply}, openai=True, **fields)


BATCH_ROUTES: tuple[Op, ...] = (
    _op(
        "post",
        "/v1/files",
        "Upload a batch's input file (JSONL)",
        Reply(FileObject),
        body=FileUpload,
        body_media="multipart/form-data",
        errors=(400, 413),
    ),
    _op("get", "/v1/files", "Files, newest first", Reply(FileList), query=_page(10_000)),
    _op("get", "/v1/files/{file_id}", "A file", Reply(FileObject), errors=(404,)),
    _op(
        "get",
        "/v1/files/{file_id}/content",
        "A file's bytes",
        Reply(media="application/octet-stream"),
        errors=(404,),
    ),
    _op("delete", "/v1/files/{file_id}", "Delete a file", Reply(FileDeleted), errors=(404,)),
    _op(
        "post",
        "/v1/batches",
        "Run a file's requests as a batch",
        Reply(Batch),
        body=BatchCreate,
        errors=(400, 404),
    ),
    _op("get", "/v1/batches", "Batches, newest first", Reply(BatchList), query=_page(100)),
    _op("get", "/v1/batches/{batch_id}", "A batch", Reply(Batch), errors=(404,)),
    _op(
        "post",
        "/v1/batches/{batch_id}/cancel",
        "Cancel a batch: no more lines sent, those in flight cancelled",
        Reply(Batch),
        errors=(404, 409),
    ),
)
