"""The project's exceptions, each with the HTTP status and error type it maps to, and how any
exception reads as an answer (`render`): pure, so the Flask error funnel (exo_tasks.api.errors)
and the batch code, which runs in the worker without Flask, answer alike."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

log = logging.getLogger("exo_tasks.api")
# An error as an answer: its status, JSON body and headers besides the body.
Rendered = tuple[int, dict[str, Any], dict[str, str]]


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


def is_out_of_memory(exc: BaseException) -> bool:
    """Redis at its maxmemory refused a write: an OOM reply, also as a script's error or
    through kombu (which re-raises it as its own OperationalError)."""
    while True:
        if "when used memory > 'maxmemory'" in str(exc):
            return True
        if exc.__cause__ is None:
            return False
        exc = exc.__cause__


# What a client of a refused request waits: a Sentinel failover takes 3 to 8 s (docs/ha.md).
REDIS_RETRY_AFTER_S = 2


def redis_unreachable(exc: BaseException | None) -> bool:
    """Redis did not answer (or has no master yet): redis-py's error, also as the cause of
    kombu's OperationalError (a message that could not be sent)."""
    # Here, not at the top: the launcher and `exo-tasks redis` raise our errors without redis-py.
    import redis

    while exc is not None:
        if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
            return True
        exc = exc.__cause__
    return False


def render(exc: Exception, *, openai: bool) -> Rendered:
    """Any exception as an answer: invalid input 422, the project's errors their own status,
    Redis full or unreachable 503, anything else logged once and 500. `openai`: in OpenAI's
    error shape (its routes answer so, for OpenAI clients), else the project's."""
    if isinstance(exc, ValidationError):
        return _invalid(exc, openai)
    if isinstance(exc, ExoError):
        return (
            *error_body(exc.status, exc.type, exc.message, exc.details, openai=openai),
            exc.headers(),
        )
    return _unexpected(exc, openai)


def error_body(
    status: int,
    type_: str,
    message: str,
    details: Any = None,
    *,
    openai: bool,
    code: str | None = None,
) -> tuple[int, dict[str, Any]]:
    """The status and body of an error, in the project's shape or OpenAI's (which answers
    any invalid request with 400); `code` is OpenAI's only."""
    if not openai:
        return status, {"error": {"type": type_, "message": message, "details": details}}
    param = _param(details)
    if status == 422:
        status = 400
    if status == 404 and param == "model":
        code = "model_not_found"
    return status, openai_error_body(status, message, param=param, code=code or type_)


def openai_error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    type_ = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _param(details: Any) -> str | None:
    """The field an error concerns, from either kind of `details`."""
    if isinstance(details, list) and details and isinstance(details[0], dict):
        details = details[0]
    field = details.get("field") if isinstance(details, dict) else None
    return str(field) if field is not None else None


def validation_details(exc: ValidationError) -> list[dict[str, Any]]:
    """Each problem with the field it concerns, as a dotted path ('messages.0.role')."""
    return [
        {
            "field": ".".join(str(p) for p in err["loc"]) or None,
            "message": (
                "not supported"
                if err["type"] == "extra_forbidden"
                else err["msg"].removeprefix("Value error, ")
            ),
        }
        for err in exc.errors(include_url=False, include_input=False)
    ]


def _invalid(exc: ValidationError, openai: bool) -> Rendered:
    details = validation_details(exc)
    summary = "; ".join(
        f"{d['field']}: {d['message']}" if d["field"] else d["message"] for d in details
    )
    unsupported = exc.errors()[0]["type"] == "extra_forbidden"
    code = "unsupported_parameter" if unsupported else "invalid_value"
    status, body = error_body(422, "invalid_request", summary, details, openai=openai, code=code)
    return status, body, {}


def _unexpected(exc: Exception, openai: bool) -> Rendered:
    if is_out_of_memory(exc):
        log.error("redis is full: %s", exc)
        full = StorageFull(
            "the job store (Redis) is full and refuses writes; retry later "
            "(EXO_REDIS_MAXMEMORY_MB, EXO_JOB_TTL_S)"
        )
        return (*error_body(full.status, full.type, full.message, openai=openai), {})
    if redis_unreachable(exc):
        log.error("redis unreachable: %s", exc)
        message = "the broker (Redis) is unreachable; retry soon"
        retry = {"Retry-After": str(REDIS_RETRY_AFTER_S)}
        return (*error_body(503, "unavailable", message, openai=openai), retry)
    log.exception("unhandled error")
    return (
        *error_body(500, "internal_error", "internal error; see the API logs", openai=openai),
        {},
    )
