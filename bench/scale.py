"""Queue scale, on the `tiny` model: enqueue 10,000 1-token jobs through the API (a few
senders at once) while 2 workers drain them; jobs/s in and out, and Redis's peak memory."""

from __future__ import annotations

import json
import logging
import threading
import time

from bench.clients import REQUEST_ERRORS, Connection
from bench.config import Config
from bench.contenders import Lab, start_exo
from bench.results import EXO, Results
from exo_tasks.store import Store, job_key
from exo_tasks.types import TERMINAL_JOB_STATUSES

log = logging.getLogger("bench")
SECTION = "queue_scale"
STALL_S = 30.0
BACKOFF_S = 0.05


def _send(url: str, prefix: str, count: int, ids: list[str]) -> None:
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


def _wait_drained(store: Store, ids: list[str]) -> int:
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
        ids: list[str] = []
        per_sender = config.scale_jobs // config.scale_senders
        senders = [
            threading.Thread(target=_send, args=(stack.url, f"s{i}", per_sender, ids))
            for i in range(config.scale_senders)
        ]
        started = time.monotonic()
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
        enqueue_s = time.monotonic() - started
        unfinished = _wait_drained(stack.store, ids)
        records = [stack.store.jobs.get(job_id) for job_id in ids]
        jobs = [r for r in records if r is not None and r.finished_at is not None]
        first = min(j.created_at for j in jobs)
        last = max(j.finished_at for j in jobs if j.finished_at is not None)
        succeeded = sum(1 for j in jobs if j.status == "succeeded")
        memory = stack.store.redis.info("memory")
    finally:
        lab.stop(stack.processes)
    results.sample(SECTION, "enqueue rate", EXO, "jobs/s", len(ids) / enqueue_s)
    results.sample(SECTION, "drain rate", EXO, "jobs/s", len(jobs) / (last - first).total_seconds())
    results.sample(SECTION, "peak Redis memory", EXO, "MiB", memory["used_memory_peak"] / 2**20)
    row = results.find(SECTION, "drain rate", EXO)
    if row is not None:
        row.note = f"{succeeded} of {len(ids)} jobs succeeded"
        if unfinished:
            row.note += f"; {unfinished} never ended (none ended for {STALL_S:.0f}s)"
