"""Slow, stalled and malformed clients against the real `exo-tasks api` (gunicorn): they cost
no thread while their request has not arrived, are cut off after the header timeout (the head)
and the body timeout (the body), and never starve `/healthz`; gunicorn's own errors, and a body
it cannot parse, are JSON in the API's error shape."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from email.message import Message
from email.utils import collapse_rfc2231_value
from pathlib import Path

import pytest
import requests

from tests.support.processes import Processes, start_api
from tests.support.stack import Stack

STALLED = 150  # the reported attack: 100 s of /healthz timeouts with gunicorn's own gthread
HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 3  # EXO_API_BODY_TIMEOUT_S, short here as the header timeout is


@dataclass
class Gunicorn:
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)


@pytest.fixture(scope="module")
def gunicorn(
    stack: Stack, module_processes: Processes, tmp_path_factory: pytest.TempPathFactory
) -> Gunicorn:
    """One `exo-tasks api` for the module: every test closes the connections it opened, so
    none leaves the server otherwise than it found it."""
    tmp_path = tmp_path_factory.mktemp("gunicorn")
    api = start_api(
        module_processes,
        tmp_path / "api.log",
        redis_url=stack.redis.url,
        data_dir=tmp_path,
        api_header_timeout_s=HEADER_TIMEOUT_S,
        api_body_timeout_s=BODY_TIMEOUT_S,
    )
    return Gunicorn(api.port, api.log_path)


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


def raw_reply(api: Gunicorn, request: bytes) -> tuple[bytes, bytes]:
    """The head and body of the answer to `request`, sent as it is."""
    with api.connect() as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, body = reply.split(b"\r\n\r\n", 1)
    return head, body


def raw_request(api: Gunicorn, request: bytes) -> tuple[int, dict[str, str]]:
    head, body = raw_reply(api, request)
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


def test_a_malformed_chunked_body_is_400_in_the_error_shape(gunicorn: Gunicorn) -> None:
    """gunicorn's InvalidChunkSize reached the error funnel as an unknown error: 500."""
    head = (
        b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    for body in (b"ZZ\r\n{}\r\n0\r\n\r\n", b"2\r\n{}XX0\r\n\r\n"):
        status, error = raw_request(gunicorn, head + body)
        assert (status, error["type"]) == (400, "bad_request"), error
        assert "the request body is malformed" in error["message"]
    assert healthz_s(gunicorn) < 1.0


def test_a_body_trickled_past_the_body_timeout_is_cut_off(gunicorn: Gunicorn) -> None:
    """A byte a second never stalls a read for EXO_API_IO_TIMEOUT_S: it held its request for
    ever. The whole body now has EXO_API_BODY_TIMEOUT_S."""
    body = json.dumps({"prompt": "a" * 100, "max_tokens": 1}).encode()
    head = (
        b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    with gunicorn.connect() as sock:
        # Read the clock before the head goes: the server's deadline starts once it has the
        # head, and a client descheduled after sending it would start later (CI: 2.997 s).
        started = time.monotonic()
        sock.sendall(head)
        for byte in body:  # 5 bytes a second: the whole body would take 24 s
            if select.select([sock], [], [], 0.2)[0]:  # the answer came
                break
            sock.sendall(bytes([byte]))
        took = time.monotonic() - started
        sock.settimeout(5)
        reply = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(4096):
                reply += chunk
    assert BODY_TIMEOUT_S <= took < BODY_TIMEOUT_S + 3, took
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["type"] == "request_timeout" and "EXO_API_BODY_TIMEOUT_S" in error["message"]


def test_merged_slashes_are_no_route_and_no_redirect(gunicorn: Gunicorn) -> None:
    """`//v1//jobs` was a 308 with an HTML body and a Location built from the client's Host."""
    request = b"GET //v1//jobs HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n"
    head, body = raw_reply(gunicorn, request)
    assert head.startswith(b"HTTP/1.1 404 "), head
    assert b"location:" not in head.lower() and b"evil.example" not in head + body
    assert json.loads(body)["error"]["type"] == "not_found"


def multipart_upload(filename: bytes) -> bytes:
    """A file upload whose part names the file as given (clients escape a quote as `\\"`)."""
    content = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions"})
    part = (
        b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--B\r\nContent-Disposition: form-data; name="file"; filename="' + filename + b'"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\n" + content.encode() + b"\r\n--B--\r\n"
    )
    return part


@pytest.mark.parametrize(
    ("sent", "stored"),
    [
        ("日本語.jsonl".encode(), "日本語.jsonl"),
        (b"a\x00b.jsonl", "a\x00b.jsonl"),
        (b'x\\"; filename=evil.sh; y=\\".jsonl', 'x"; filename=evil.sh; y=".jsonl'),
        ("é\\\\.jsonl".encode(), "é\\.jsonl"),
    ],
)
def test_every_stored_file_name_downloads_and_injects_nothing(
    gunicorn: Gunicorn, sent: bytes, stored: str
) -> None:
    """A name that is not Latin-1 (or holds NUL) made the download a 500 (gunicorn's
    InvalidResponseHeader); a `"` in it added header parameters. RFC 6266 `filename*` now."""
    with requests.Session() as http:
        uploaded = http.post(
            f"{gunicorn.url}/v1/files",
            data=multipart_upload(sent),
            headers={"Content-Type": "multipart/form-data; boundary=B"},
            timeout=10,
        )
        assert uploaded.status_code == 200, uploaded.text
        assert uploaded.json()["filename"] == stored
        download = http.get(f"{gunicorn.url}/v1/files/{uploaded.json()['id']}/content", timeout=10)
    assert download.status_code == 200, download.text
    disposition = download.headers["Content-Disposition"]
    message = Message()
    message["Content-Disposition"] = disposition
    params = message.get_params(header="content-disposition")
    assert params is not None and [key for key, _ in params] == [
        "attachment",
        "filename",  # an ASCII fallback
        "filename",  # filename*, decoded
    ], disposition
    assert collapse_rfc2231_value(params[2][1]) == stored, disposition
