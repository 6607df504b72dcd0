"""One error funnel: every exception becomes the JSON error shape, never an HTML page. What an
exception answers is exo_tasks.errors.render's to say; Werkzeug's own errors are read here."""

from __future__ import annotations

from typing import Any

from flask import Flask, Response, current_app, jsonify, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from exo_tasks.errors import error_body, render

# These routes answer errors in OpenAI's shape, so that OpenAI clients can read them.
OPENAI_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/files",
    "/v1/batches",
)


def handle(exc: Exception) -> Response:
    """Every exception a request raises, as the JSON error shape: Werkzeug's their own status,
    the rest as exo_tasks.errors.render answers them."""
    if isinstance(exc, HTTPException):
        return _http_error(exc)
    status, body, headers = render(exc, openai=_is_openai_route())
    return _json(status, body, headers)


def _is_openai_route() -> bool:
    return any(request.path == p or request.path.startswith(p + "/") for p in OPENAI_PATHS)


def _json(status: int, body: dict[str, Any], headers: dict[str, str]) -> Response:
    response = jsonify(body)
    response.status_code = status
    response.headers.update(headers)
    return response


def _http_error(exc: HTTPException) -> Response:
    openai = _is_openai_route()
    if isinstance(exc, RequestEntityTooLarge):
        limit = current_app.config["MAX_CONTENT_LENGTH"]
        message = f"the request body is larger than {limit} bytes (EXO_MAX_BODY_BYTES)"
        details = {"limit_bytes": limit}
        return _json(
            *error_body(413, "request_entity_too_large", message, details, openai=openai), {}
        )
    type_ = exc.name.lower().replace(" ", "_")
    status, body = error_body(exc.code or 500, type_, exc.description or "", openai=openai)
    # What the exception says besides its body, such as `Allow` on a 405 (RFC 9110).
    return _json(status, body, {k: v for k, v in exc.get_headers() if k != "Content-Type"})


def init_app(app: Flask) -> None:
    app.register_error_handler(Exception, handle)
