"""gunicorn's gevent worker, kept from slow and vanished clients, with its own errors in the
API's JSON shape.

Every connection is a greenlet, so an open event stream costs no thread: thousands stay open
beside `/healthz` (the gthread worker held a thread per stream, and 64 streams starved every
other request). Redis and Celery calls cooperate through gevent's monkey patching.

What the gthread worker of issue 18 protected against still holds:
- a connection that has sent nothing waits at most gunicorn's `keepalive`, then is closed;
- once a request's first byte has arrived, the client has EXO_API_HEADER_TIMEOUT_S to send the
  rest of its head, then gets 408 in the error shape (a trickled request line holds a greenlet
  for that long, never a thread);
- every read and write on a socket times out after EXO_API_IO_TIMEOUT_S (a body sent slowly, a
  client that stops reading its response), and a body must arrive whole within
  EXO_API_BODY_TIMEOUT_S (exo_tasks.api.request_body);
- a client that vanishes without a FIN: TCP_USER_TIMEOUT (EXO_API_IO_TIMEOUT_S) makes the kernel
  give up on data it cannot deliver, so a stream's keepalive (each second) fails within
  EXO_API_IO_TIMEOUT_S + 1 s and the stream is closed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import resource
import select
import socket
import warnings
from collections.abc import Callable, Iterator
from email.utils import formatdate
from typing import Any

import gevent
from gevent import socket as gsocket
from gevent.local import local
from gevent.monkey import MonkeyPatchWarning, get_original
from gevent.server import StreamServer
from gunicorn import http, util
from gunicorn.http.errors import NoMoreData
from gunicorn.workers import ggevent
from gunicorn.workers.base_async import AsyncWorker
from gunicorn.workers.ggevent import GeventWorker

from config.settings import Settings
from exo_tasks.api import arrivals, request_body
from exo_tasks.api.models import HealthReply
from exo_tasks.process_exit import exit_now

# Descriptors a worker needs beyond its connections: Redis, logs, the listening socket.
SPARE_FDS = 256
LINGER_S = 1.0
STOP_GRACE_S = 0.1
RECV_BYTES = 64 << 10
# gunicorn patches each worker once it has forked, and the master has imported redis by then:
# gevent warns that redis.asyncio keeps ssl's unpatched SSLContext. The API never uses
# redis.asyncio (nor TLS through it), so that one warning is noise; any other module named
# in it still warns.
warnings.filterwarnings(
    "ignore",
    message=(
        r"Monkey-patching ssl after ssl has already been imported .*"
        r"Modules that had direct imports \(NOT patched\): "
        r"\['redis\.asyncio\.connection \([^)]*\)'\]\. $"
    ),
    category=MonkeyPatchWarning,
)
# The OS's poll, not gevent's: asking whether bytes are waiting never switches to the hub.
_os_poll = get_original("select", "poll")


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


class ProbeAnsweringServer(StreamServer):  # type: ignore[misc]  # gevent is untyped here
    """gevent's server, answering a liveness probe where its connection is accepted.

    A new connection waits its turn behind every greenlet ready to run: with thousands of
    streams writing and jobs being submitted, twice (accepted, then its request read), and a
    probe that waits too long gets a healthy API restarted. `GET /healthz`, alone on a new
    connection and already arrived whole, is answered in the accepting callback itself, as
    the Flask route answers it (which still serves every other probe). Nothing here waits: it
    runs in gevent's hub."""

    def do_handle(self, client: Any, address: Any) -> None:
        if not _answered_probe(client):
            super().do_handle(client, address)


_PROBE = b"GET /healthz HTTP/1."
# A probe's request is small: anything longer, or with more header lines, goes through
# gunicorn's own checks (request line, header count and size limits) like any request.
PROBE_MAX_BYTES = 512
PROBE_MAX_LINES = 16
_PROBE_BODY = HealthReply().model_dump_json().encode()


def _probe_answer() -> bytes:
    date = formatdate(usegmt=True).encode()  # a 200 from a server with a clock has a Date
    return (
        b"HTTP/1.1 200 OK\r\nDate: %s\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (date, len(_PROBE_BODY), _PROBE_BODY)
    )


def _answered_probe(client: Any) -> bool:
    """Answer and close `client` if what it sent so far is exactly one probe's request."""
    if not _readable(client.fileno()):
        return False
    try:
        head = client.recv(PROBE_MAX_BYTES + 1, socket.MSG_PEEK)
    except OSError:
        return False
    end = head.find(b"\r\n\r\n") + len(b"\r\n\r\n")
    lowered = head.lower()
    whole = head.startswith(_PROBE) and end == len(head)  # its head, and nothing after it
    has_body = b"\ncontent-length:" in lowered or b"\ntransfer-encoding:" in lowered
    if not whole or has_body or head.count(b"\n") > PROBE_MAX_LINES:
        return False
    with contextlib.suppress(OSError):
        client.recv(end)
        client.send(_probe_answer())
        client.shutdown(socket.SHUT_WR)
    client.close()
    return True


class RequestTimeout(Exception):
    """A request's head did not arrive within EXO_API_HEADER_TIMEOUT_S of its first byte."""


def raise_fd_limit(wanted: int) -> int:
    """Lift this process's soft limit on open files towards `wanted` (up to the hard limit):
    every open stream is a socket. Returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return int(soft)


class StreamingWorker(GeventWorker):  # type: ignore[misc]  # gunicorn is untyped
    """gunicorn's gevent worker with the header, I/O and vanished-client bounds above."""

    wsgi: request_body.Wsgi

    def init_process(self) -> None:
        settings = Settings()
        self.header_timeout_s = settings.api_header_timeout_s
        self.io_timeout_s = settings.api_io_timeout_s
        self.body_timeout_s = settings.api_body_timeout_s
        limit = raise_fd_limit(self.worker_connections + SPARE_FDS)
        if limit < self.worker_connections + SPARE_FDS:
            self.log.warning("open files limited to %d: fewer connections fit", limit)
        # gunicorn writes its error pages through this one function, and builds its server from
        # this name; it has no setting for either.
        util.write_error = write_json_error
        ggevent.StreamServer = ProbeAnsweringServer
        http.get_parser = self._remembered(http.get_parser)
        if getattr(self, "arrivals_seat", None) is not None:  # given by gunicorn_conf.pre_fork
            arrivals.take_seat(self.arrivals_board, self.arrivals_seat)
        self._client = local()
        super().init_process()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        self.wsgi = request_body.bounded_bodies(self.wsgi, self.body_timeout_s, self._body_failed)

    def _body_failed(self) -> None:
        self._client.body_failed = True

    def handle_exit(self, sig: int, frame: Any) -> None:
        """SIGTERM: stop accepting, give requests in flight STOP_GRACE_S, then leave. Open
        streams never end by themselves, and gevent's own graceful stop waits for every
        connection (idle keep-alive ones too) up to gunicorn's graceful_timeout; the stack
        gives the API 2 s to stop. A job whose record was written but not its message is
        sent again by the recovery loop. It leaves without the interpreter's teardown (freeing
        Flask's, Celery's and pydantic's objects took 1-2 s of a loaded machine, past that
        bound): every write it owes is made synchronously in its request."""
        super().handle_exit(sig, frame)
        gevent.spawn_later(STOP_GRACE_S, self._leave)

    def _leave(self) -> None:
        self.log.info("Worker exiting (pid: %s)", self.pid)
        exit_now(0)

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        # Not GeventWorker.handle: it makes the socket blocking with no timeout at all.
        client.settimeout(self.io_timeout_s)
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux
            user_timeout_ms = int(self.io_timeout_s * 1000)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, user_timeout_ms)
        self._client.socket = client
        AsyncWorker.handle(self, listener, client, addr)

    def _remembered(self, get_parser: Callable[..., Any]) -> Callable[..., Any]:
        """gunicorn's parser factory, keeping each connection's parser for timeout_ctx."""

        def get_remembered_parser(*args: Any, **kwargs: Any) -> Any:
            self._client.parser = get_parser(*args, **kwargs)
            return self._client.parser

        return get_remembered_parser

    def timeout_ctx(self) -> contextlib.AbstractContextManager[None]:
        """Wraps each wait for a request (gunicorn's keep-alive loop)."""
        return self._request_deadline(self._client.socket, self._client.parser)

    @contextlib.contextmanager
    def _request_deadline(self, client: Any, parser: Any) -> Iterator[None]:
        # A request already here is read at once: waiting for it would park the connection
        # in gevent's hub and queue it behind every other ready greenlet a second time. It
        # may be here already read: a client that pipelines sends the next request with the
        # last, and gunicorn's parser holds what it read past the last one.
        if not (_read_ahead(parser) or _readable(client.fileno())):
            try:
                gsocket.wait_read(client.fileno(), timeout=self.cfg.keepalive)
            except TimeoutError:  # silent since its last request (or since it connected)
                raise NoMoreData() from None
        with gevent.Timeout(self.header_timeout_s, RequestTimeout):
            yield

    def handle_request(self, listener_name: Any, req: Any, sock: Any, addr: Any) -> Any:
        self._client.body_failed = False
        try:
            handled = super().handle_request(listener_name, req, sock, addr)
        except TimeoutError as exc:  # the I/O timeout, or TCP_USER_TIMEOUT: expected, no trace
            self.log.warning("client gone (%s): connection closed", exc)
            # gunicorn closes a connection after EPIPE without logging a stack trace.
            raise BrokenPipeError(errno.EPIPE, "client gone") from exc
        if self._client.body_failed:  # answered; what is left of its body is no request
            _linger(sock)
            raise StopIteration("the request's body failed: connection closed")
        return handled

    def handle_error(self, req: Any, client: Any, addr: Any, exc: BaseException) -> None:
        if isinstance(exc, RequestTimeout):
            self.log.warning("request not sent within the header timeout: closed")
            message = f"the request did not arrive within {self.header_timeout_s:g}s"
            with contextlib.suppress(OSError):
                write_json_error(client, 408, "Request Timeout", message)
        else:
            super().handle_error(req, client, addr, exc)
        _linger(client)


def _read_ahead(parser: Any) -> bool:
    """Whether gunicorn's parser holds bytes it read past the last request."""
    unreader = getattr(parser, "unreader", None)
    return unreader is not None and bool(unreader.buf.getvalue())


def _readable(fd: int) -> bool:
    """Whether bytes (or the end) wait on `fd`, without waiting."""
    poller = _os_poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def _linger(client: Any) -> None:
    """Read what the client still sends (the rest of a refused request) for a moment before
    the close: closing with unread bytes sends a reset, which can destroy the error response
    before the client reads it."""
    with contextlib.suppress(OSError), gevent.Timeout(LINGER_S, False):
        client.shutdown(socket.SHUT_WR)
        while client.recv(RECV_BYTES):
            pass
