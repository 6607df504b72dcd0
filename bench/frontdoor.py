"""The front door, on the `tiny` model: 100, 500 and 2,000 streamed completions
(`POST /v1/completions`, `stream: true`) opened at once and held open, against exo_tasks (2 API
workers, one host) and mlx_lm.server. Reported: time to first byte p50/p99, `/healthz` p99
while they are open (a new connection per probe, from a process of its own), API memory, Redis
connections, and errors (connection resets, refusals, streams with no first byte within
TTFB_TIMEOUT_S).

A stream's time to first byte counts from its request sent, as load generators count it (k6's
`http_req_waiting`): the server's accept queue, parsing and answer are in it, and this client's
own time to open 2,000 sockets on the same 2 cores (0.5-1.5 s) is not. That time is reported
beside it, as the client's connect p99.

The streams are held by one asyncio client (a socket each, no thread) that keeps reading, so
nothing backs up; the jobs queue behind the runner's batch, so the streams overlap for long.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import psutil

from bench.config import Config
from bench.contenders import Lab, start_exo, start_mlx_server
from bench.results import EXO, MLX_SERVER, Results, percentile
from exo_tasks.store import Store
from tests.support.processes import Processes

log = logging.getLogger("bench")
SECTION = "front_door"
LEVELS = (100, 500, 2000)
MAX_TOKENS = 256
TTFB_TIMEOUT_S = 30.0
HOLD_S = 10.0  # streams held open, /healthz probed meanwhile (bench/probe.py)
PROBE_S = HOLD_S - 1.0


@dataclass
class Streams:
    """What the client saw of its streams."""

    ttfbs_s: list[float] = field(default_factory=list)  # from its request sent
    connects_s: list[float] = field(default_factory=list)  # this client's, to its request sent
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def _stream(port: int, index: int, seen: Streams, release: asyncio.Event) -> None:
    body = json.dumps(
        {"prompt": f"door {index}: once upon a time", "max_tokens": MAX_TOKENS, "stream": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    connecting = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port), TTFB_TIMEOUT_S
        )
    except (OSError, TimeoutError) as exc:
        seen.error(f"connect: {type(exc).__name__}")
        return
    try:
        writer.write(head + body)  # sent now: asyncio writes at once while nothing is queued
        sent = time.monotonic()
        seen.connects_s.append(sent - connecting)
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TTFB_TIMEOUT_S)
        seen.ttfbs_s.append(time.monotonic() - sent)
        status = first.split(b" ", 2)[1].decode()
        if status != "200":
            seen.error(f"HTTP {status}")
            return
        while not release.is_set():  # keep reading: a stream that backs up is not the test
            reading = asyncio.ensure_future(reader.read(65536))
            await asyncio.wait([reading, asyncio.ensure_future(release.wait())], timeout=1.0)
            if reading.done() and not reading.result():
                break  # its job ended
            reading.cancel()
    except TimeoutError:
        seen.error("no first byte in time")
    except (ConnectionError, asyncio.IncompleteReadError) as exc:
        seen.error(type(exc).__name__)
    finally:
        writer.close()


async def _hold(port: int, count: int, hold_s: float, opened: threading.Event) -> Streams:
    seen = Streams()
    release = asyncio.Event()
    tasks = [asyncio.ensure_future(_stream(port, i, seen, release)) for i in range(count)]
    deadline = time.monotonic() + TTFB_TIMEOUT_S + 5
    while len(seen.ttfbs_s) + sum(seen.errors.values()) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    opened.set()
    await asyncio.sleep(hold_s)
    release.set()
    await asyncio.wait(tasks, timeout=30)
    return seen


def _probe_healthz(url: str, seconds: float) -> list[float]:
    """Probe times from bench.probe, in a session (and so a CPU share) of its own."""
    argv = [sys.executable, "-m", "bench.probe", url, str(seconds)]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=seconds + 30, start_new_session=True
    )
    done.check_returncode()
    times: list[float] = json.loads(done.stdout)
    return times


def _tree_rss_mib(processes: Processes, marker: str) -> float:
    """Resident memory of the started process whose command line has `marker`, children too."""
    total = 0
    for proc in processes.started:
        root = psutil.Process(proc.pid)
        if any(marker in part for part in root.cmdline()):
            total += sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    return total / 2**20


def _redis_clients(store: Store) -> float:
    """Connections to the stack's Redis (its workers' too, and this bench's one)."""
    return float(store.redis.info("clients")["connected_clients"])


def _measure(
    results: Results,
    contender: str,
    url: str,
    health_url: str,
    count: int,
    memory: Callable[[], float],
    redis_clients: Callable[[], float] | None,
) -> None:
    port = int(url.rsplit(":", 1)[1])
    idle_mib = memory()
    opened = threading.Event()
    probes: list[float] = []
    prober = threading.Thread(target=lambda: probes.extend(_probe_healthz(health_url, PROBE_S)))
    during: dict[str, float] = {}

    def sample_while_open() -> None:
        opened.wait()
        prober.start()
        time.sleep(HOLD_S / 2)
        during["memory"] = memory()
        if redis_clients is not None:
            during["redis"] = redis_clients()

    sampler = threading.Thread(target=sample_while_open)
    sampler.start()
    seen = asyncio.run(_hold(port, count, HOLD_S, opened))
    sampler.join()
    prober.join()
    level = f"{count} streams"
    errors = sum(seen.errors.values())
    if seen.ttfbs_s:
        results.sample(SECTION, f"TTFB p50, {level}", contender, "s", percentile(seen.ttfbs_s, 50))
        results.sample(SECTION, f"TTFB p99, {level}", contender, "s", percentile(seen.ttfbs_s, 99))
    if seen.connects_s:
        connect_p99 = percentile(seen.connects_s, 99)
        results.sample(SECTION, f"client's connect p99, {level}", contender, "s", connect_p99)
    if probes:
        p99_ms = percentile(probes, 99) * 1e3
        results.sample(SECTION, f"/healthz p99, {level}", contender, "ms", p99_ms)
    results.sample(SECTION, f"memory, {level}", contender, "MiB", during.get("memory", idle_mib))
    per_stream_kib = (during.get("memory", idle_mib) - idle_mib) * 1024 / count
    results.sample(SECTION, f"memory per stream, {level}", contender, "KiB", per_stream_kib)
    if "redis" in during:
        results.sample(SECTION, f"Redis connections, {level}", contender, "", during["redis"])
    results.sample(SECTION, f"errors, {level}", contender, "", errors)
    row = results.find(SECTION, f"errors, {level}", contender)
    if row is not None and seen.errors:
        row.note = ", ".join(f"{kind}: {n}" for kind, n in sorted(seen.errors.items()))
    log.info("front door %s %s: %d errors %s", contender, level, errors, seen.errors)


def run(lab: Lab, config: Config, results: Results) -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a socket per stream, here too
    for count in LEVELS:
        # Every stream comes from the bench, one client: its quota raised with the queue's.
        room = {"max_queued_jobs": 4 * max(LEVELS), "max_queued_jobs_per_client": 4 * max(LEVELS)}
        stack = start_exo(lab, f"exo-door-{count}", config.tiny_model, **room)
        try:
            _measure(
                results,
                EXO,
                stack.url,
                f"{stack.url}/healthz",
                count,
                partial(_tree_rss_mib, stack.processes, "api"),
                partial(_redis_clients, stack.store),
            )
        finally:
            lab.stop(stack.processes)
        server = start_mlx_server(lab, f"mlx-door-{count}", config.tiny_model)
        try:
            _measure(
                results,
                MLX_SERVER,
                server.url,
                f"{server.url}/health",
                count,
                partial(_tree_rss_mib, server.processes, "mlx_lm"),
                None,
            )
        finally:
            lab.stop(server.processes)
