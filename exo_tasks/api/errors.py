"""One error funnel: every exception becomes the JSON error shape, never an HTML page."""

from __future__ import annotations

import logging
from typing import Any

import redis
from flask import Flask, Response, jsonify
from pydantic import ValidationError
from werkzeug.exceptions import HTTPException

from exo_tasks.errors import ExoError, QueueFull

log = logging.getLogger("exo_tasks.api")


def error_response(status: int, type_: str, message: str, details: Any = None) -> Response:
    response = jsonify({"error": {"type": type_, "message": message, "details": details}})
    response.status_code = status
    return response


def validation_details(exc: ValidationError) -> list[dict[str, Any]]:
    """Each problem with the field it concerns, as a dotted path ('messages.0.role')."""
    return [
        {
            "field": ".".join(str(p) for p in err["loc"]) or None,
            "message": err["msg"].removeprefix("Value error, "),
        }
        for err in exc.errors(include_url=False, include_input=False)
    ]


def handle(exc: Exception) -> Response:
    if isinstance(exc, ValidationError):
        details = validation_details(exc)
        summary = "; ".join(
            f"{d['field']}: {d['message']}" if d["field"] else d["message"] for d in details
        )
        return error_response(422, "invalid_request", summary, details)
    if isinstance(exc, ExoError):
        response = error_response(exc.status, exc.type, exc.message, exc.details)
        if isinstance(exc, QueueFull):
            response.headers["Retry-After"] = str(exc.retry_after_s)
        return response
    if isinstance(exc, HTTPException):
        code = exc.code or 500
        return error_response(code, exc.name.lower().replace(" ", "_"), exc.description or "")
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        log.error("redis unreachable: %s", exc)
        return error_response(503, "unavailable", "the broker (Redis) is unreachable; retry soon")
    log.exception("unhandled error")
    return error_response(500, "internal_error", "internal error; see the API logs")


def init_app(app: Flask) -> None:
    app.register_error_handler(Exception, handle)
