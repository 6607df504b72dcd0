"""Slow and stalled clients against the real `exo-tasks api` (gunicorn): they cost no thread
while their request has not arrived, are cut off after the header timeout, and never starve
`/healthz`; gunicorn's own errors are JSON in the API's error shape."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tests.conftest import Stack
from tests.support.processes import EXO_TASKS, Processes, exo_env, free_port, wait_http

STALLED = 150  # the reported attack: 100 s of /healthz timeouts with gunicorn's own gthread
HEADER_TIMEOUT_S = 2


@dataclass
class Gunicorn:
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)


@pytest.fixture
def gunicorn(stack: Stack, processes: Processes, tmp_path: Path) -> Gunicorn:
    port = free_port()
    env = exo_env(
        redis_url=stack.redis.url,
        api_port=port,
        data_dir=tmp_path,
        api_header_timeout_s=HEADER_TIMEOUT_S,
    )
    log_path = tmp_path / "api.log"
    process = processes.start([EXO_TASKS, "api"], env, log_path)
    wait_http(f"http://127.0.0.1:{port}/healthz", process, log_path)
    return Gunicorn(port, log_path)


@contextlib.contextmanager
def stalled_connections(api: Gunicorn, count: int, sent: bytes) -> Iterator[list[socket.socket]]:
    sockets = []
    try:
        for _ in range(count):
            sock = api.connect()
            sock.sendall(sent)
            sockets.append(sock)
        yield sockets
    finally:
        for sock in sockets:
            sock.close()


def healthz_s(api: Gunicorn) -> float:
    started = time.monotonic()
    with requests.Session() as session:  # a new connection each time
        response = session.get(f"{api.url}/healthz", timeout=5)
    assert response.status_code == 200
    return time.monotonic() - started


def test_healthz_answers_within_a_second_beside_150_stalled_requests(gunicorn: Gunicorn) -> None:
    with stalled_connections(gunicorn, STALLED, b"GET /healthz HT"):
        times = [healthz_s(gunicorn) for _ in range(10)]
    assert max(times) < 1.0, times


def test_a_request_line_trickled_past_the_header_timeout_is_cut_off(gunicorn: Gunicorn) -> None:
    with gunicorn.connect() as sock:
        started = time.monotonic()
        reply = b""
        with contextlib.suppress(OSError):
            for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\n" * 10:
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
        sock.settimeout(HEADER_TIMEOUT_S + 6)
        with contextlib.suppress(OSError):
            while chunk := sock.recv(4096):
                reply += chunk
    assert time.monotonic() - started < HEADER_TIMEOUT_S + 6
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["type"] == "request_timeout"


def raw_request(api: Gunicorn, request: bytes) -> tuple[int, dict[str, str]]:
    with api.connect() as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, body = reply.split(b"\r\n\r\n", 1)
    status = int(head.split(b" ")[1])
    assert b"content-type: application/json" in head.lower(), head
    error: dict[str, str] = json.loads(body)["error"]
    assert set(error) == {"type", "message", "details"}
    return status, error


@pytest.mark.parametrize(
    ("request_bytes", "status", "kind"),
    [
        (b"NOT A REQUEST\r\n\r\n", 400, "bad_request"),
        (b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long"),
        (
            b"GET /healthz HTTP/1.1\r\n"
            + b"".join(b"X-%d: y\r\n" % i for i in range(200))
            + b"\r\n",
            431,
            "request_header_fields_too_large",
        ),
    ],
)
def test_gunicorn_errors_are_json_in_the_error_shape(
    gunicorn: Gunicorn, request_bytes: bytes, status: int, kind: str
) -> None:
    answered, error = raw_request(gunicorn, request_bytes)
    assert (answered, error["type"]) == (status, kind) and error["message"], error
