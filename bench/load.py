"""Closed-loop load: N clients, each sending its next request as soon as the last one ended,
measured over fixed-duration windows (not fixed job counts, so slow contenders take no longer).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench.clients import Client, Trace

STAGGER_S = 0.02  # between client starts: 32 connects at once make mlx_lm.server reset some
ERROR_PAUSE_S = 0.2


def prompt_for(client: int, request: int, series: str = "load") -> str:
    """A distinct prompt per request (and per `series` of requests) that differs from every
    other from its first character, so mlx_lm.server's prompt cache (the KV cache of an earlier
    prompt, reused for a shared prefix) never shortens a prefill: every prompt is prefilled in
    full by every contender."""
    head = hashlib.sha256(f"{series}/{client}/{request}".encode()).hexdigest()[:8]
    return f"{head}: client {client}, request {request}, once upon a time"


@dataclass
class Window:
    start: float
    end: float

    def tokens(self, trace: Trace) -> int:
        return sum(1 for t in trace.token_times if self.start <= t < self.end)

    def contains(self, moment: float) -> bool:
        return self.start <= moment < self.end


@dataclass
class WindowStats:
    tokens_per_s: float
    jobs_per_s: float
    ttfts_s: list[float]
    errors: int


@dataclass
class LoadRun:
    traces: list[Trace]
    windows: list[Window]
    max_tokens: int

    def stats(self, window: Window) -> WindowStats:
        """Tokens streamed inside the window; jobs counted by the share of their tokens that
        streamed inside it (a window that ends mid-batch is not penalised, nor one that
        happens to hold a whole batch's last tokens favoured); TTFT of requests sent in it."""
        seconds = window.end - window.start
        tokens = 0
        jobs = 0.0
        for trace in self.traces:
            inside = window.tokens(trace)
            tokens += inside
            jobs += inside / max(trace.completion_tokens or self.max_tokens, 1)
        ttfts = [
            t.ttft_s for t in self.traces if t.ttft_s is not None and window.contains(t.started)
        ]
        errors = sum(1 for t in self.traces if t.error and window.contains(t.started))
        return WindowStats(tokens / seconds, jobs / seconds, ttfts, errors)

    @property
    def short_jobs(self) -> int:
        """Finished jobs with fewer tokens than asked for (an EOS on a server without
        ignore_eos); they are counted by their real token count."""
        return sum(
            1
            for t in self.traces
            if t.completion_tokens is not None and t.completion_tokens < self.max_tokens
        )


def closed_loop(
    make_client: Callable[[], Client],
    clients: int,
    *,
    max_tokens: int,
    windows: int,
    window_s: float,
    ramp_timeout_s: float = 120.0,
    first_tokens_timeout_s: float = 0.0,
) -> LoadRun:
    """Run `clients` clients through the ramp, then measure `windows` consecutive windows of
    `window_s`, or of the first finished request's latency if longer: with every client in the
    same batch, jobs start and end together, and a window shorter than a job's life would see
    only its decoding or mostly its prefill. Then no new request is sent; with
    `first_tokens_timeout_s`, the requests sent inside the windows are waited for until each
    has its first token (their TTFT would be missing otherwise, and only the fast ones
    counted). Requests still in flight at the end are left to the caller, who stops the
    contender."""
    stop = threading.Event()
    traces: list[Trace] = []
    lock = threading.Lock()
    firsts: list[Trace | None] = [None] * clients

    def loop(index: int) -> None:
        client = make_client()
        request = 0
        while not stop.is_set():
            trace = Trace(time.monotonic())
            with lock:
                traces.append(trace)
            if firsts[index] is None:
                firsts[index] = trace
            client.run(trace, prompt_for(index, request), max_tokens)
            request += 1
            if trace.error and not stop.is_set():
                time.sleep(ERROR_PAUSE_S)

    for index in range(clients):
        threading.Thread(target=loop, args=(index,), name=f"client-{index}", daemon=True).start()
        time.sleep(STAGGER_S)
    deadline = time.monotonic() + ramp_timeout_s
    while time.monotonic() < deadline and not _ramped(firsts):
        time.sleep(0.05)
    start = time.monotonic()
    window_s = max([window_s] + [t.latency_s for t in firsts if t and t.latency_s is not None])
    measured = [Window(start + i * window_s, start + (i + 1) * window_s) for i in range(windows)]
    time.sleep(windows * window_s)
    stop.set()
    end = measured[-1].end
    deadline = time.monotonic() + first_tokens_timeout_s
    while time.monotonic() < deadline and any(
        t.started < end and not t.token_times and not t.error for t in list(traces)
    ):
        time.sleep(0.05)
    with lock:
        return LoadRun(list(traces), measured, max_tokens)


def _ramped(firsts: list[Trace | None]) -> bool:
    """The ramp ends once every client has sent its first request and one of those has
    ended: the next ones are sent by then, and its latency is one job's whole life."""
    started = [t for t in firsts if t is not None]
    return len(started) == len(firsts) and any(t.ended for t in started)


def sequential(client: Client, count: int, max_tokens: int, series: str) -> list[Trace]:
    """`count` requests one after another from one client."""
    traces = []
    for request in range(count):
        trace = Trace(time.monotonic())
        client.run(trace, prompt_for(0, request, series), max_tokens)
        traces.append(trace)
    return traces
