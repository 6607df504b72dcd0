"""gunicorn's gthread worker, kept from slow clients, with its own errors in the API's JSON shape.

gunicorn 27's gthread worker commits a thread to a connection as soon as it has a byte to read,
then reads the request with a blocking socket and no timeout: 150 connections that send half a
request line held every thread, and `/healthz` waited for good. Here a connection gets a thread
only once its whole request has arrived (the headers, and a body of announced length up to
EXO_MAX_BODY_BYTES): until then what it sent is kept with the connection, which waits in the
worker's poller like an idle keep-alive one and costs no thread. A client gets
EXO_API_HEADER_TIMEOUT_S to send it (then 408); one that goes silent is closed after gunicorn's
`keepalive`. Once a thread has the request, every read and write on its socket times out after
EXO_API_IO_TIMEOUT_S (a chunked body, a client that stops reading its response).
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from gunicorn import util
from gunicorn.workers.gthread import _DEFER, ThreadWorker

from config.settings import Settings

HEAD_END = b"\r\n\r\n"
MAX_HEAD_BYTES = 64 << 10  # past this the parser has the request and refuses it (414, 431)
RECV_BYTES = 64 << 10
CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d{1,19})[ \t]*\r", re.IGNORECASE)


def write_json_error(sock: socket.socket, status: int, reason: str, message: str) -> None:
    """gunicorn's own error responses (a bad request line, 414, 431, …), in the error shape of
    every other response of the API instead of gunicorn's HTML page."""
    error = {"type": reason.lower().replace(" ", "_"), "message": message, "details": None}
    body = json.dumps({"error": error}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    util.write_nonblock(sock, head.encode("latin-1") + body)


class _TimedSocket(socket.socket):
    """A socket whose blocking mode has a timeout: gunicorn sets sockets blocking (no timeout)
    for the thread that serves a request."""

    io_timeout_s = 30.0

    def setblocking(self, flag: bool) -> None:
        # Closed already (see SlowClientSafeWorker.handle): gunicorn's close then does nothing.
        with contextlib.suppress(OSError):
            self.settimeout(self.io_timeout_s if flag else 0.0)


@dataclass
class _Incoming:
    """A request arriving on a connection, kept until it is whole."""

    deadline: float
    data: bytearray = field(default_factory=bytearray)

    def whole(self, max_body_bytes: int) -> bool:
        end = self.data.find(HEAD_END)
        if end < 0:
            return len(self.data) > MAX_HEAD_BYTES
        length = CONTENT_LENGTH.search(self.data, 0, end + 2)
        body = int(length[1]) if length else 0  # chunked: read by the thread, under its timeout
        # A body over the cap is refused (413) from its Content-Length, unread.
        return len(self.data) >= end + len(HEAD_END) + (body if body <= max_body_bytes else 0)


class SlowClientSafeWorker(ThreadWorker):  # type: ignore[misc]  # gunicorn is untyped
    """The gthread worker, giving a thread only to a connection whose request has arrived."""

    def init_process(self) -> None:
        settings = Settings()
        self.header_timeout_s = settings.api_header_timeout_s
        self.max_body_bytes = settings.max_body_bytes
        _TimedSocket.io_timeout_s = settings.api_io_timeout_s
        # gunicorn writes its error pages through this one function, and has no setting for it.
        util.write_error = write_json_error
        super().init_process()

    def enqueue_req(self, conn: Any) -> None:
        if not isinstance(conn.sock, _TimedSocket):  # a new connection
            plain = conn.sock
            conn.sock = _TimedSocket(plain.family, plain.type, plain.proto, fileno=plain.detach())
            conn.sock.setblocking(False)
        super().enqueue_req(conn)

    def handle(self, conn: Any) -> Any:
        """Serve the connection's request if it has all arrived; else give it back to the
        poller (`_DEFER`) to wait for more, or close it (False)."""
        buffered = conn.parser is not None and conn.parser.unreader.buf.getvalue()
        if self.cfg.is_ssl or buffered:  # TLS reads records; read-ahead bytes are a request
            return super().handle(conn)
        try:
            incoming = self._read_available(conn)
        except ConnectionError:  # the client closed, or reset
            util.close(conn.sock)
            return False
        if incoming is None:
            return _DEFER
        if incoming.whole(self.max_body_bytes):
            del conn.exo_incoming
            conn.init()
            conn.parser.unreader.unread(bytes(incoming.data))
            return super().handle(conn)
        if time.monotonic() > incoming.deadline:
            self.log.warning("request not sent within the header timeout: closed")
            message = f"the request did not arrive within {self.header_timeout_s:g}s"
            with contextlib.suppress(OSError):
                write_json_error(conn.sock, 408, "Request Timeout", message)
            util.close(conn.sock)  # not gunicorn's graceful close: it lingers in the main loop
            return False
        return _DEFER

    def _read_available(self, conn: Any) -> _Incoming | None:
        """Add what the client has sent so far to the connection's request; None while it has
        sent nothing. ConnectionError when it closed or reset."""
        incoming: _Incoming | None = getattr(conn, "exo_incoming", None)
        while incoming is None or not incoming.whole(self.max_body_bytes):
            try:
                data = conn.sock.recv(RECV_BYTES)
            except BlockingIOError:
                break
            except OSError as exc:
                raise ConnectionError from exc
            if not data:
                raise ConnectionError
            if incoming is None:
                incoming = conn.exo_incoming = _Incoming(time.monotonic() + self.header_timeout_s)
            incoming.data += data
        return incoming
