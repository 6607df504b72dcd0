"""A batch through a worker SIGKILL (the worker holding the feeder's lease, its pool children
and runner going with it) and an API restart, or through a Redis SIGKILL and restart: it still
completes, every line exactly once in its output or error file. A Redis of its own, so that the
only feeder is the one killed and the Redis killed is no other test's."""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import openai

from exo_tasks.batch.jobs import line_job_id
from exo_tasks.store import Store
from tests.support.api import api_settings, serving
from tests.support.batches import chat_line, read_file, start, wait_status
from tests.support.clients import client_for
from tests.support.processes import Processes, start_redis, wait_until
from tests.support.workers import new_worker

LINES = 300
# A line long enough to be still running when the worker is killed (a 24-token line's job can
# end between the test seeing it run and the kill).
LONG_LINE, LONG_TOKENS = 40, 1500


def running(store: Store, batch_id: str) -> bool:
    jobs = store.jobs.records([line_job_id(batch_id, i) for i in store.batches.inflight(batch_id)])
    return any(job is not None and job.status == "running" for job in jobs)


def wait_mid_batch(
    client: openai.OpenAI, store: Store, batch_id: str, line: int | None = None
) -> None:
    """Until some lines are done and a line's job (that `line`'s, if given) runs: the feeder is
    busy with the batch."""

    def done_at_least(count: int) -> bool:
        counts = client.batches.retrieve(batch_id).request_counts
        return counts is not None and counts.completed >= count

    wait_until(lambda: done_at_least(30), 120, "30 lines done", interval_s=0.2)
    if line is None:
        wait_until(lambda: running(store, batch_id), 30, "a line's job running")
        return
    job_id = line_job_id(batch_id, line)

    def line_running() -> bool:
        # Running and recorded in flight: the feeder sends a tick's lines, then records them,
        # so a line's job can run before the line is in flight.
        job = store.jobs.get(job_id)
        in_flight = line in store.batches.inflight(batch_id)
        return in_flight and job is not None and job.status == "running"

    wait_until(line_running, 60, f"line {line}'s job running, the line in flight")


def each_line_once(output: list[dict[str, Any]], errors: list[dict[str, Any]]) -> None:
    seen = Counter(line["custom_id"] for line in output + errors)
    assert set(seen) == {f"k{i}" for i in range(LINES)}
    assert max(seen.values()) == 1, [k for k, n in seen.items() if n > 1]


def test_worker_sigkill_and_api_restart_mid_batch_lose_nothing_twice_nothing(
    processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    redis = start_redis(processes, tmp_path / "redis")
    store = Store.from_url(redis.url)
    worker = new_worker(processes, redis.url, store, "bk-1", [tiny_model], tmp_path)
    lines = [chat_line(f"k{i}", f"n{i}", max_tokens=24, ignore_eos=True) for i in range(LINES)]
    lines[LONG_LINE]["body"]["max_tokens"] = LONG_TOKENS
    settings = api_settings(redis.url, [tiny_model])
    with serving(settings) as api, client_for(api) as client:
        batch_id = start(client, lines).id
        # Mid-batch: jobs running, the feeder's lease held by this worker; killed at once, while
        # the long line's job runs. The API goes too.
        wait_mid_batch(client, store, batch_id, LONG_LINE)
        worker.process.send_signal(signal.SIGKILL)
        worker.process.wait(timeout=10)
    assert store.batches.inflight(batch_id), "the kill lands with lines in flight"
    with serving(settings) as api, client_for(api) as client:
        assert client.batches.retrieve(batch_id).status == "in_progress"
        new_worker(processes, redis.url, store, "bk-1", [tiny_model], tmp_path)
        batch = wait_status(client, batch_id, {"completed", "failed", "cancelled"}, 120)
        assert batch.status == "completed", (batch.errors, batch.request_counts)
        output = read_file(client, batch.output_file_id)
        errors = read_file(client, batch.error_file_id)
    each_line_once(output, errors)
    assert not errors, errors[:3]  # the requeued jobs ran again and succeeded
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (LINES, 0)
    long_job = store.jobs.get(line_job_id(batch_id, LONG_LINE))
    assert long_job is not None and long_job.attempts >= 1, "the job killed running was requeued"
    # Each line's job ran its request once to the end: requeued ones start over.
    for line in output:
        usage = line["response"]["body"]["usage"]
        expected = LONG_TOKENS if line["custom_id"] == f"k{LONG_LINE}" else 24
        assert usage["completion_tokens"] == expected, line["custom_id"]


def test_redis_sigkill_and_restart_mid_batch_lose_nothing_twice_nothing(
    processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    redis = start_redis(processes, tmp_path / "redis")
    store = Store.from_url(redis.url)
    new_worker(processes, redis.url, store, "br-1", [tiny_model], tmp_path)
    lines = [chat_line(f"k{i}", f"n{i}", max_tokens=24, ignore_eos=True) for i in range(LINES)]
    with serving(api_settings(redis.url, [tiny_model])) as api, client_for(api) as client:
        batch_id = start(client, lines).id
        wait_mid_batch(client, store, batch_id)
        # Redis dies under the feeder, the worker, its runner and the API at once; it comes back
        # 2 s later on the same port with its AOF (every write fsynced), as a supervisor would.
        redis.process.send_signal(signal.SIGKILL)
        redis.process.wait(timeout=5)
        time.sleep(2)
        start_redis(processes, tmp_path / "redis", redis.port)
        batch = wait_status(client, batch_id, {"completed", "failed", "cancelled"}, 120)
        assert batch.status == "completed", (batch.errors, batch.request_counts)
        output = read_file(client, batch.output_file_id)
        errors = read_file(client, batch.error_file_id)
    each_line_once(output, errors)
    # None may fail: every process waits for Redis and repeats what it was doing (the runner keeps
    # what it owes, a task waits or is requeued, the feeder repeats its tick), and 2 s is shorter
    # than a heartbeat's TTL, so no host is taken for dead and no job for orphaned.
    assert not errors, errors[:3]
    assert batch.request_counts is not None
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (LINES, LINES, 0)
