"""Batches, on the `tiny` model: the same requests as one OpenAI batch and as concurrent
requests from a client; an interactive request's time to first token on an idle stack and while
the batch runs; and the Redis memory the batch takes (its files, and its jobs' records, kept
for EXO_JOB_TTL_S)."""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from bench.clients import ExoClient, Trace
from bench.config import Config
from bench.contenders import ExoStack, Lab, start_exo
from bench.results import EXO, Results, Target

log = logging.getLogger("bench")
SECTION = "batch"
ENDPOINT = "/v1/completions"
MAX_TOKENS = 16
# The client's concurrency: as many as a runner batches at once, so the fleet is kept full.
SENDERS = 32
TTFT_SAMPLES = 5
TIMEOUT_S = 1800.0


def _prompt(i: int) -> str:
    return f"request {i}"


def _body(i: int) -> dict[str, Any]:
    return {"model": "tiny", "prompt": _prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0}


def _input(lines: int) -> bytes:
    rows = [
        {"custom_id": f"r{i}", "method": "POST", "url": ENDPOINT, "body": _body(i)}
        for i in range(lines)
    ]
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def _concurrent(url: str, lines: int) -> float:
    """Requests per second with SENDERS clients sending the batch's requests as jobs."""

    def send(sender: int) -> int:
        client, failed = ExoClient(url), 0
        for i in range(sender, lines, SENDERS):
            trace = Trace(started=time.monotonic())
            client.run(trace, _prompt(i), MAX_TOKENS)
            failed += trace.error is not None
        return failed

    started = time.monotonic()
    with ThreadPoolExecutor(SENDERS) as pool:
        failed = sum(pool.map(send, range(SENDERS)))
    took = time.monotonic() - started
    if failed:
        log.warning("batch bench: %d direct requests failed", failed)
    return lines / took


def _ttft(url: str) -> float:
    trace = Trace(started=time.monotonic())
    ExoClient(url).run(trace, "interactive", 4)
    return trace.ttft_s if trace.ttft_s is not None else float("nan")


class Batch:
    """One batch, followed to its end; its memory sampled as it runs."""

    def __init__(self, stack: ExoStack, lines: int) -> None:
        self.stack, self.lines = stack, lines
        self.peak = self.memory()

    def memory(self) -> int:
        used: int = self.stack.store.redis.info("memory")["used_memory"]
        return used

    def run(self, during: list[float]) -> tuple[float, dict[str, Any]]:
        """Requests per second from create to completed; TTFTs sampled while it runs."""
        url = self.stack.url
        uploaded = requests.post(
            url + "/v1/files",
            files={"file": ("bench.jsonl", _input(self.lines))},
            data={"purpose": "batch"},
            timeout=60,
        ).json()
        self.uploaded = self.memory()
        body = {"input_file_id": uploaded["id"], "endpoint": ENDPOINT}
        started = time.monotonic()
        batch = requests.post(url + "/v1/batches", json=body, timeout=30).json()
        sampler = threading.Thread(target=self._sample_ttft, args=(during,), daemon=True)
        sampler.start()
        while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
            assert time.monotonic() - started < TIMEOUT_S, "the batch did not end"
            time.sleep(0.1)
            self.peak = max(self.peak, self.memory())
            batch = requests.get(f"{url}/v1/batches/{batch['id']}", timeout=30).json()
        took = time.monotonic() - started
        sampler.join()
        return self.lines / took, batch

    def _sample_ttft(self, during: list[float]) -> None:
        time.sleep(2.0)  # the batch is under way
        for _ in range(TTFT_SAMPLES):
            during.append(_ttft(self.stack.url))
            time.sleep(0.5)


def run(lab: Lab, config: Config, results: Results) -> None:
    lines = config.batch_lines
    log.info("batch: %d lines against %d concurrent requests", lines, SENDERS)
    # Every direct job comes from the bench, one client: its quota raised with the queue's.
    room = {"max_queued_jobs": lines * 2, "max_queued_jobs_per_client": lines * 2}
    stack = start_exo(lab, "exo-batch", config.tiny_model, **room)
    try:
        idle = [_ttft(stack.url) for _ in range(TTFT_SAMPLES)]
        direct = _concurrent(stack.url, lines)
        batch = Batch(stack, lines)
        before = batch.memory()
        during: list[float] = []
        rate, ended = batch.run(during)
        after = batch.memory()
    finally:
        lab.stop(stack.processes)
    results.sample(SECTION, f"{lines} requests, concurrent", EXO, "req/s", direct)
    results.sample(SECTION, f"{lines} requests, one batch", EXO, "req/s", rate)
    for value in idle:
        results.sample(SECTION, "interactive TTFT, idle", EXO, "s", value)
    for value in during:
        results.sample(SECTION, "interactive TTFT, during the batch", EXO, "s", value)
    mib = 2**20
    results.sample(SECTION, "Redis: input file", EXO, "MiB", (batch.uploaded - before) / mib)
    results.sample(SECTION, "Redis: peak while running", EXO, "MiB", (batch.peak - before) / mib)
    results.sample(SECTION, "Redis: after, files + job records", EXO, "MiB", (after - before) / mib)
    row = results.find(SECTION, f"{lines} requests, one batch", EXO)
    reference = results.find(SECTION, f"{lines} requests, concurrent", EXO)
    if row is not None and reference is not None:
        counts = ended["request_counts"]
        row.note = f"{ended['status']}: {counts['completed']} completed, {counts['failed']} failed"
        name = "a batch >= 0.9x the same requests sent concurrently"
        results.targets.append(Target(name, row, reference, ">=", 0.9))
