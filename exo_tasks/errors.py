"""The project's exceptions. Each carries the HTTP status and error type it maps to."""

from __future__ import annotations

from typing import Any


class ExoError(Exception):
    """Base class: the API turns any ExoError into its JSON error shape and status."""

    status = 500
    type = "internal_error"

    def __init__(self, message: str, details: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def headers(self) -> dict[str, str]:
        """HTTP headers the error response carries besides the JSON body."""
        return {}


class InvalidRequest(ExoError):
    status = 422
    type = "invalid_request"


class Unauthorized(ExoError):
    status = 401
    type = "unauthorized"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class NotFound(ExoError):
    status = 404
    type = "not_found"


class Conflict(ExoError):
    status = 409
    type = "conflict"


class ComeBackLater(ExoError):
    """A refusal for now: the response says when to try again (`Retry-After`)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, {"retry_after_s": retry_after_s})
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class QueueFull(ComeBackLater):
    status = 429
    type = "queue_full"


class ClientQuotaFull(QueueFull):
    """The client has EXO_MAX_QUEUED_JOBS_PER_CLIENT jobs waiting."""

    type = "client_quota_full"


class StreamsFull(ComeBackLater):
    """This API process has EXO_MAX_STREAMS streams open."""

    status = 503
    type = "streams_full"


class Unavailable(ExoError):
    """Redis or every runner for a model is down."""

    status = 503
    type = "unavailable"


class RunnerGone(ExoError):
    """The runner a job was handed to died or stopped before finishing it."""

    type = "runner_gone"


class BadRequest(ExoError):
    """Input that cannot even be parsed: JSON nested too deeply, a malformed number or id."""

    status = 400
    type = "bad_request"


class StorageFull(Unavailable):
    """Redis refused a write: it is at its `maxmemory` and never evicts job or queue keys."""

    type = "storage_full"
