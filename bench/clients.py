"""Streaming HTTP clients, one per contender's API, that time every token they receive.

Plain `http.client`: its `readline()` returns each server-sent event as soon as it arrives,
whether the body is chunked (gunicorn) or read until close (mlx_lm.server speaks HTTP/1.0),
where a buffered reader would hold tokens back and distort time to first token.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from tests.support import sse

TIMEOUT_S = 300.0
# What a request can fail with; it is recorded on its trace and counted, never raised.
REQUEST_ERRORS = (OSError, http.client.HTTPException, ValueError, KeyError, RuntimeError)


@dataclass
class Trace:
    """One request as its client saw it; times are `time.monotonic()` seconds."""

    started: float
    token_times: list[float] = field(default_factory=list)
    ended: float | None = None
    completion_tokens: int | None = None  # as the server counted them (usage)
    error: str | None = None
    # Set to end the request early, at its next token: exo_tasks's client cancels the job,
    # mlx_lm.server's disconnects (its handler's failed write stops the generation).
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.started if self.token_times else None

    @property
    def latency_s(self) -> float | None:
        return self.ended - self.started if self.ended is not None and not self.error else None


class Client(Protocol):
    def run(self, trace: Trace, prompt: str, max_tokens: int) -> None:
        """Send one streaming request and fill `trace` as tokens arrive."""


class Connection:
    """One keep-alive connection (re-opened after an error or a server-side close)."""

    def __init__(self, base_url: str, timeout_s: float = TIMEOUT_S) -> None:
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.timeout_s = timeout_s  # of each read: the longest silence a request may keep
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)

    def open(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        self.conn.request(method, path, body=payload, headers=headers)
        return self.conn.getresponse()

    def reset(self) -> None:
        self.conn.close()
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)


def _lines(response: Any) -> Iterator[str]:
    while line := response.readline():
        yield line.decode().rstrip("\r\n")


class ExoClient:
    """`POST /v1/jobs`, then `GET /v1/jobs/<id>/stream` until the `done` (or `error`) event."""

    def __init__(self, base_url: str, **job: Any) -> None:
        self.base_url = base_url
        self.http = Connection(base_url)
        self.job = job  # extra job fields, e.g. ignore_eos

    def run(self, trace: Trace, prompt: str, max_tokens: int) -> None:
        try:
            created = self.http.open(
                "POST", "/v1/jobs", {"prompt": prompt, "max_tokens": max_tokens, **self.job}
            )
            reply = json.loads(created.read())
            if created.status != 202:
                raise RuntimeError(f"POST /v1/jobs: {created.status} {reply}")
            stream = self.http.open("GET", f"/v1/jobs/{reply['id']}/stream")
            cancelled = False
            for event in sse.events(_lines(stream)):
                if event["event"] == "token":
                    trace.token_times.append(time.monotonic())
                    if trace.stop.is_set() and not cancelled:
                        cancelled = self._cancel(reply["id"])
                elif event["event"] in ("done", "error"):
                    trace.ended = time.monotonic()
                    job = event["data"]
                    trace.completion_tokens = job["usage"]["completion_tokens"]
                    if job["status"] != "succeeded" and not cancelled:
                        trace.error = f"job {job['status']}: {job['error']}"
                    break
            stream.read()  # the end of the chunked body, so the connection can be reused
            if trace.ended is None:
                raise RuntimeError("the stream ended before the job did")
        except REQUEST_ERRORS as exc:
            trace.error = trace.error or f"{type(exc).__name__}: {exc}"
            self.http.reset()

    def _cancel(self, job_id: str) -> bool:
        http = Connection(self.base_url)
        try:
            return bool(http.open("POST", f"/v1/jobs/{job_id}/cancel", {}).status == 202)
        finally:
            http.conn.close()


class CompletionsClient:
    """`POST /v1/completions` with `stream: true`, usage requested in the last chunk: an
    OpenAI client's streamed completion, of mlx_lm.server or of exo_tasks.

    mlx_lm.server has no ignore_eos: the bench model rarely samples its EOS (its logit is
    scaled down), and the tokens counted are the ones the server reports in `usage`.
    """

    def __init__(self, base_url: str, timeout_s: float = TIMEOUT_S) -> None:
        # It sends nothing before a completion's first token: `timeout_s` must outlast a prefill.
        self.http = Connection(base_url, timeout_s)

    def run(self, trace: Trace, prompt: str, max_tokens: int) -> None:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            response = self.http.open("POST", "/v1/completions", body)
            if response.status != 200:
                raise RuntimeError(f"POST /v1/completions: {response.status}")
            for chunk in sse.chunks(_lines(response)):
                if chunk.get("usage"):
                    trace.ended = time.monotonic()
                    trace.completion_tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0].get("text"):
                    trace.token_times.append(time.monotonic())
                    if trace.stop.is_set():
                        trace.ended = time.monotonic()
                        self.http.reset()
                        return
            response.read()
            if trace.ended is None:
                raise RuntimeError("the stream ended before the completion did")
        except REQUEST_ERRORS as exc:
            trace.error = f"{type(exc).__name__}: {exc}"
            self.http.reset()
