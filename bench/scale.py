"""Queue scale, on the `tiny` model: enqueue 10,000 1-token jobs through the API (a few
senders at once) while 2 workers drain them; jobs/s in and out, and Redis's peak memory."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

from bench.clients import REQUEST_ERRORS, Connection
from bench.config import Config
from bench.contenders import ExoStack, Lab, start_exo
from bench.results import EXO, Results
from exo_tasks.store import Store, job_key
from exo_tasks.types import TERMINAL_JOB_STATUSES

log = logging.getLogger("bench")
SECTION = "queue_scale"
STALL_S = 30.0
BACKOFF_S = 0.05


def send(url: str, prefix: str, count: int, ids: list[str]) -> None:
    http = Connection(url)
    sent = 0
    while sent < count:
        body = {"prompt": f"{prefix} job {sent}", "max_tokens": 1, "ignore_eos": True}
        try:
            response = http.open("POST", "/v1/jobs", body)
            reply = json.loads(response.read())
        except REQUEST_ERRORS:
            http.reset()
            continue
        if response.status == 202:
            ids.append(reply["id"])
            sent += 1
        else:  # 429 (the queue is full) or 503: back off and send the job again
            time.sleep(BACKOFF_S)


def wait_drained(store: Store, ids: list[str]) -> int:
    """Wait until every job has ended, or until none has for STALL_S; returns how many did
    not end."""
    pending = list(ids)
    progress_at = time.monotonic()
    while pending and time.monotonic() - progress_at < STALL_S:
        time.sleep(0.5)
        pipe = store.redis.pipeline(transaction=False)
        for job_id in pending:
            pipe.hget(job_key(job_id), "status")
        statuses = pipe.execute()
        left = [j for j, s in zip(pending, statuses, strict=True) if s not in TERMINAL_JOB_STATUSES]
        if len(left) < len(pending):
            progress_at = time.monotonic()
        pending = left
    return len(pending)


def run(lab: Lab, config: Config, results: Results) -> None:
    for _ in range(config.scale_repeats):
        _run_once(lab, config, results)


@dataclass
class Drained:
    """Jobs sent by several senders at once through the API, and how the queue drained them."""

    sent: int
    enqueue_s: float
    jobs_per_s: float  # ended jobs / (last ended - first created)
    succeeded: int
    unfinished: int  # never ended: none ended for STALL_S

    @property
    def note(self) -> str:
        note = f"{self.succeeded} of {self.sent} jobs succeeded"
        if self.unfinished:
            note += f"; {self.unfinished} never ended (none ended for {STALL_S:.0f}s)"
        return note


def drain(stack: ExoStack, count: int, senders: int) -> Drained:
    """`count` 1-token jobs sent by `senders` at once; returns once all ended (or stalled)."""
    ids: list[str] = []
    threads = [
        threading.Thread(target=send, args=(stack.url, f"s{i}", count // senders, ids))
        for i in range(senders)
    ]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    enqueue_s = time.monotonic() - started
    unfinished = wait_drained(stack.store, ids)
    records = [stack.store.jobs.get(job_id) for job_id in ids]
    jobs = [r for r in records if r is not None and r.finished_at is not None]
    first = min(j.created_at for j in jobs)
    last = max(j.finished_at for j in jobs if j.finished_at is not None)
    succeeded = sum(1 for j in jobs if j.status == "succeeded")
    rate = len(jobs) / (last - first).total_seconds()
    return Drained(len(ids), enqueue_s, rate, succeeded, unfinished)


def _run_once(lab: Lab, config: Config, results: Results) -> None:
    log.info("queue scale: %d jobs, %d workers", config.scale_jobs, config.scale_workers)
    stack = start_exo(
        lab,
        "exo-scale",
        config.tiny_model,
        workers=config.scale_workers,
        max_queued_jobs=config.scale_jobs * 2,
        # Every job comes from the bench, one client: its quota raised with the queue's.
        max_queued_jobs_per_client=config.scale_jobs * 2,
    )
    try:
        drained = drain(stack, config.scale_jobs, config.scale_senders)
        memory = stack.store.redis.info("memory")
    finally:
        lab.stop(stack.processes)
    results.sample(SECTION, "enqueue rate", EXO, "jobs/s", drained.sent / drained.enqueue_s)
    results.sample(SECTION, "drain rate", EXO, "jobs/s", drained.jobs_per_s)
    results.sample(SECTION, "peak Redis memory", EXO, "MiB", memory["used_memory_peak"] / 2**20)
    row = results.find(SECTION, "drain rate", EXO)
    if row is not None:
        row.note = drained.note
