"""OpenAI's Files and Batch objects, as the `openai` client reads them, and what a batch keeps
between processes. Pure: the API, the feeder (on a worker) and the CLI share these."""

from __future__ import annotations

import enum
import re
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from exo_tasks.wire import WireModel

BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions"]


class BatchStatus(enum.StrEnum):
    """A batch's status, as OpenAI names it. Which status may follow which is
    exo_tasks.lifecycle's BATCH_TRANSITIONS."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


# Where a batch has nothing more to do.
BATCH_ENDED: frozenset[BatchStatus] = frozenset(
    {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)
FilePurpose = Literal["batch", "batch_output"]
# OpenAI takes "24h" only; a shorter window is the user's to set (a test's expiry, a deadline).
WINDOW = re.compile(r"^([1-9][0-9]{0,5})([smh])$")
WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600}
MAX_WINDOW_S = 24 * 3600


def window_seconds(window: str) -> int:
    """A completion window ("24h", "90m", "30s") in seconds; ValueError for anything else."""
    match = WINDOW.fullmatch(window)
    if match is None:
        raise ValueError("must be a number and a unit (s, m or h), such as '24h'")
    seconds = int(match.group(1)) * WINDOW_UNITS[match.group(2)]
    if seconds > MAX_WINDOW_S:
        raise ValueError("must be at most 24h")
    return seconds


class FileObject(BaseModel):
    """A stored file (OpenAI's `file` object)."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: FilePurpose
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchCreate(WireModel):
    """Body of POST /v1/batches."""

    input_file_id: str = Field(min_length=1)
    endpoint: BatchEndpoint
    completion_window: str = Field("24h", description="'24h' as OpenAI, or shorter: '90m', '30s'")
    metadata: dict[str, str] | None = Field(None, max_length=16)

    @field_validator("completion_window")
    @classmethod
    def _window(cls, value: str) -> str:
        window_seconds(value)
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, item in (value or {}).items():
            if len(key) > 64 or len(item) > 512:
                raise ValueError("keys are at most 64 characters, values at most 512")
        return value


class BatchError(BaseModel):
    """Why a batch's input file did not validate, naming its line (1-based)."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class Batch(BaseModel):
    """OpenAI's `batch` object, as stored (the counts are read live while it runs)."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: BatchEndpoint
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus = BatchStatus.VALIDATING
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None

    @property
    def ended(self) -> bool:
        return self.status in BATCH_ENDED


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class LineResponse(BaseModel):
    status_code: int
    request_id: str
    body: dict[str, Any]


class LineError(BaseModel):
    code: str
    message: str


class ResultLine(BaseModel):
    """One line of a batch's output file (a response) or error file (a response that is an
    error, or an `error` for a request that never ran)."""

    id: str
    custom_id: str
    response: LineResponse | None = None
    error: LineError | None = None
