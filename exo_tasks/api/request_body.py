"""A request's body as the app reads it under gunicorn (exo_tasks.api.gunicorn_worker): whole
within EXO_API_BODY_TIMEOUT_S, and a body gunicorn cannot parse is the client's error.

Each read already times out after EXO_API_IO_TIMEOUT_S without a byte, but a body trickled a
byte a second never stalls that long and held its request for ever. And gunicorn raises its
own exceptions from a read (a chunk size of `ZZ`: InvalidChunkSize), which reached the app's
error funnel as unknown errors: 500. Here both are the project's errors (408, 400), answered
in the error shape; the connection is closed after the answer, since the rest of such a body
cannot be told from the next request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import gevent
from gunicorn.http.errors import NoMoreData, ParseException

from exo_tasks.errors import BadRequest, ExoError

Wsgi = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class BodyTimeout(ExoError):
    status = 408
    type = "request_timeout"


class DeadlineBody:
    """gunicorn's body of one request, every read bounded by what is left of the deadline."""

    def __init__(self, body: Any, timeout_s: float) -> None:
        self._body = body
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self.failed = False

    def read(self, size: int | None = None) -> bytes:
        data: bytes = self._bounded(self._body.read, size)
        return data

    def readline(self, size: int | None = None) -> bytes:
        line: bytes = self._bounded(self._body.readline, size)
        return line

    def readlines(self, size: int | None = None) -> list[bytes]:
        lines: list[bytes] = self._bounded(self._body.readlines, size)
        return lines

    def __iter__(self) -> Iterator[bytes]:
        while line := self.readline():
            yield line

    def _bounded(self, read: Callable[[int | None], Any], size: int | None) -> Any:
        timeout = BodyTimeout(
            f"the request body did not arrive within {self._timeout_s:g}s (EXO_API_BODY_TIMEOUT_S)",
            {"limit_s": self._timeout_s},
        )
        try:
            with gevent.Timeout(max(0.0, self._deadline - time.monotonic()), timeout):
                return read(size)
        except (BodyTimeout, ParseException, NoMoreData) as exc:
            self.failed = True
            if isinstance(exc, BodyTimeout):
                raise
            raise BadRequest(f"the request body is malformed: {exc}", {"field": None}) from None


def bounded_bodies(app: Wsgi, timeout_s: float, on_failed: Callable[[], None]) -> Wsgi:
    """`app` with each request's body a DeadlineBody; `on_failed` is called once a request
    whose body failed has been answered (its connection must close)."""

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        body = DeadlineBody(environ["wsgi.input"], timeout_s)
        environ["wsgi.input"] = body
        try:
            return app(environ, start_response)
        finally:
            if body.failed:
                on_failed()

    return wrapped
