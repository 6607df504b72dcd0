"""The small HTTP helpers every blueprint shares: the JSON body, server-sent events."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

from flask import Response, request, stream_with_context
from werkzeug.exceptions import RequestEntityTooLarge

from exo_tasks import json_input
from exo_tasks.errors import BadRequest, InvalidRequest

KEEPALIVE = ": keepalive\n\n"


def json_body(*, allow_empty: bool = False) -> dict[str, Any]:
    """The request's JSON object; `allow_empty`: a missing body means `{}` (all defaults).
    A body that cannot be read (not JSON, not UTF-8, not sent as JSON, nested too deeply)
    is 400; one that is read but holds a string that is not text is 422 naming the field."""
    data = _whole_body()
    if not data and allow_empty:
        return {}
    if not request.is_json:
        message = "the body must be JSON, sent with Content-Type: application/json"
        raise BadRequest(message, {"field": None})
    body = json_input.parse(data)
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object", {"field": None})
    return body


def _whole_body() -> bytes:
    """The request body. Werkzeug stops reading a body without Content-Length (chunked) at the
    EXO_MAX_BODY_BYTES cap and hands over the part it read: a byte more means 413."""
    data = request.get_data()
    limit = request.max_content_length
    unsized = request.content_length is None and limit is not None and len(data) >= limit
    if unsized and request.environ["wsgi.input"].read(1):
        raise RequestEntityTooLarge()
    return data


def sse_event(event_id: str, name: str, data: Any) -> str:
    """One server-sent event: its id (a stream position, for Last-Event-ID), name and data."""
    head = f"id: {event_id}\n" if event_id else ""  # none: the resume point stays where it was
    return f"{head}event: {name}\ndata: {json.dumps(data)}\n\n"


def sse_response(chunks: Iterator[str], *, on_close: Callable[[], None]) -> Response:
    """A streamed response; `on_close` runs once it has ended, however (the server closes
    every response, even one whose client left before its first chunk), and only once: it
    releases what the stream counted."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    response = Response(stream_with_context(chunks), mimetype="text/event-stream", headers=headers)
    response.call_on_close(_once(on_close))
    return response


def _once(action: Callable[[], None]) -> Callable[[], None]:
    """`action`, run by the first call alone (a response may be closed more than once)."""
    lock = threading.Lock()
    done = False

    def run() -> None:
        nonlocal done
        with lock:
            if done:
                return
            done = True
        action()

    return run
