"""One error funnel: every exception becomes the JSON error shape, never an HTML page."""

from __future__ import annotations

import logging
from typing import Any

import redis
from flask import Flask, Response, current_app, jsonify, request
from pydantic import ValidationError
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from exo_tasks.errors import ExoError, StorageFull
from exo_tasks.store import is_out_of_memory

log = logging.getLogger("exo_tasks.api")
# These routes answer errors in OpenAI's shape, so that OpenAI clients can read them.
OPENAI_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/files",
    "/v1/batches",
)


def error_response(
    status: int, type_: str, message: str, details: Any = None, *, code: str | None = None
) -> Response:
    """The project's error shape, or OpenAI's on its routes; `code` is OpenAI's only."""
    if _is_openai_route():
        param = _param(details)
        if status == 422:  # OpenAI answers any invalid request with 400
            status = 400
        if status == 404 and param == "model":
            code = "model_not_found"
        body = openai_error_body(status, message, param=param, code=code or type_)
    else:
        body = {"error": {"type": type_, "message": message, "details": details}}
    response = jsonify(body)
    response.status_code = status
    return response


def openai_error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    type_ = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _is_openai_route() -> bool:
    return any(request.path == p or request.path.startswith(p + "/") for p in OPENAI_PATHS)


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


def handle(exc: Exception) -> Response:
    """Every exception a request raises, as the JSON error shape: invalid input 422, the
    project's errors their own status, Werkzeug's theirs, Redis full or unreachable 503,
    anything else logged once and 500."""
    if isinstance(exc, ValidationError):
        return _invalid(exc)
    if isinstance(exc, ExoError):
        response = error_response(exc.status, exc.type, exc.message, exc.details)
        response.headers.update(exc.headers())
        return response
    if isinstance(exc, HTTPException):
        return _http_error(exc)
    return _unexpected(exc)


def _invalid(exc: ValidationError) -> Response:
    details = validation_details(exc)
    summary = "; ".join(
        f"{d['field']}: {d['message']}" if d["field"] else d["message"] for d in details
    )
    unsupported = exc.errors()[0]["type"] == "extra_forbidden"
    return error_response(
        422,
        "invalid_request",
        summary,
        details,
        code="unsupported_parameter" if unsupported else "invalid_value",
    )


def _http_error(exc: HTTPException) -> Response:
    if isinstance(exc, RequestEntityTooLarge):
        limit = current_app.config["MAX_CONTENT_LENGTH"]
        message = f"the request body is larger than {limit} bytes (EXO_MAX_BODY_BYTES)"
        return error_response(413, "request_entity_too_large", message, {"limit_bytes": limit})
    code = exc.code or 500
    response = error_response(code, exc.name.lower().replace(" ", "_"), exc.description or "")
    # What the exception says besides its body, such as `Allow` on a 405 (RFC 9110).
    response.headers.update({k: v for k, v in exc.get_headers() if k != "Content-Type"})
    return response


def _unexpected(exc: Exception) -> Response:
    if is_out_of_memory(exc):
        log.error("redis is full: %s", exc)
        full = StorageFull(
            "the job store (Redis) is full and refuses writes; retry later "
            "(EXO_REDIS_MAXMEMORY_MB, EXO_JOB_TTL_S)"
        )
        return error_response(full.status, full.type, full.message)
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        log.error("redis unreachable: %s", exc)
        return error_response(503, "unavailable", "the broker (Redis) is unreachable; retry soon")
    log.exception("unhandled error")
    return error_response(500, "internal_error", "internal error; see the API logs")


def init_app(app: Flask) -> None:
    app.register_error_handler(Exception, handle)
