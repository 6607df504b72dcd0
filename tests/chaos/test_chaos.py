"""Break the running system on purpose and prove that nothing accepted is lost.

Each case has its own redis-server, workers and API with the default broker settings (an hour's
visibility timeout: recovery must come from heartbeats, not redelivery), and records its figures
for docs/reliability.md.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from exo_tasks.naming import host_queue, model_queue
from exo_tasks.recovery import HEARTBEAT_TTL_S
from exo_tasks.store import Store, runner_key
from exo_tasks.types import TERMINAL_JOB_STATUSES
from tests.support.api import Api, api_settings, serving
from tests.support.processes import (
    EXO_TASKS,
    Processes,
    RedisServer,
    exo_env,
    free_port,
    has_exited,
    start_redis,
    wait_http,
    wait_until,
)
from tests.support.report import Case, Report
from tests.support.workers import Worker, start_worker, wait_runner_ready


@dataclass
class Chaos:
    processes: Processes
    redis: RedisServer
    store: Store
    api: Api
    model: Path
    data_dir: Path

    def worker(self, host: str, **settings: Any) -> Worker:
        (worker,) = self.workers([host], **settings)
        return worker

    def workers(self, hosts: list[str], **settings: Any) -> list[Worker]:
        """Workers started together (their boots overlap), each waited for until it is ready."""
        workers = [
            start_worker(
                self.processes, self.redis.url, host, [self.model], self.data_dir, **settings
            )
            for host in hosts
        ]
        for worker in workers:
            wait_runner_ready(self.store, worker)
        return workers

    def outcome(self, job_ids: list[str], timeout_s: float) -> dict[str, dict[str, Any]]:
        """Every job's final record, once all are terminal."""

        def finished() -> dict[str, dict[str, Any]] | None:
            jobs = {j: self.api.get(f"/v1/jobs/{j}").json() for j in job_ids}
            active = [j for j in jobs.values() if j["status"] in ("queued", "running")]
            return None if active else jobs

        result: dict[str, dict[str, Any]] = wait_until(
            finished, timeout_s, "every job to end", interval_s=0.5
        )
        return result

    @staticmethod
    def lost(jobs: dict[str, dict[str, Any]]) -> int:
        """Accepted jobs that are unknown or did not end (0 whenever `outcome` returned)."""
        return sum(1 for j in jobs.values() if j.get("status") not in TERMINAL_JOB_STATUSES)

    def done_events(self, job_id: str) -> int:
        return [e.event for _, e in self.store.streams.read_events(job_id)].count("done")


@pytest.fixture
def chaos(processes: Processes, tiny_model: Path, tmp_path: Path) -> Iterator[Chaos]:
    redis = start_redis(processes, tmp_path / "redis")
    with serving(api_settings(redis.url, [tiny_model])) as api:
        yield Chaos(processes, redis, Store.from_url(redis.url), api, tiny_model, tmp_path)


def submit_many(api: Api, count: int, **body: Any) -> list[str]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda i: api.submit(prompt=f"job {i}", **body), range(count)))


KILL_9_JOBS = 100


def test_kill_9_of_a_worker_while_it_fetches_loses_none(chaos: Chaos, reliability: Report) -> None:
    victim = chaos.worker("chaos-a", worker_concurrency=34)
    chaos.worker("chaos-b", worker_concurrency=34)
    # More jobs than the two workers' 68 pool children, still being sent as the kill comes.
    # (Sent first and the victim watched after, on a loaded machine the jobs had all ended
    # before the last was sent, and the kill never came.)
    with ThreadPoolExecutor(1) as sender:
        sending = sender.submit(submit_many, chaos.api, KILL_9_JOBS, max_tokens=48, ignore_eos=True)
        # Kill at the worst moment: jobs run on the victim while messages are still being
        # fetched (kombu pops a message before it records it as unacknowledged: one killed in
        # between is in no queue at all), the model's and the victim's own (a job handed to
        # its runner directly has its message there), and jobs are still handed to it.
        victim_jobs = runner_key("tiny@chaos-a", "jobs")
        wait_until(
            lambda: chaos.store.redis.scard(victim_jobs) >= 3,
            20,
            "jobs running on the victim",
            interval_s=0.01,
        )
        queues = (model_queue("tiny"), host_queue("chaos-a"))
        waiting = sum(chaos.store.jobs.queue_depth(queue) for queue in queues)
        runner_pid = chaos.store.runners.get("tiny@chaos-a").pid  # type: ignore[union-attr]
        assert runner_pid is not None
        killed = time.monotonic()
        victim.process.send_signal(signal.SIGKILL)
        wait_until(lambda: has_exited(runner_pid), 5, "the victim's runner to exit")
        runner_gone_s = time.monotonic() - killed
        ids = sending.result(timeout=60)
    # Heartbeat expiry (10 s) + the requeue bound (15 s) + the jobs themselves.
    jobs = chaos.outcome(ids, timeout_s=90)
    drained_s = time.monotonic() - killed
    unsucceeded = [(j["status"], j["error"]) for j in jobs.values() if j["status"] != "succeeded"]
    assert not unsucceeded
    assert all(chaos.done_events(j) == 1 for j in ids)
    recovered = sum(1 for j in jobs.values() if j["attempts"] > 0)
    reliability.add(
        Case(
            "kill -9 one of two workers' main process while it fetches (default visibility "
            "timeout, 3600 s)",
            KILL_9_JOBS,
            "1 SIGKILL (worker main)",
            chaos.lost(jobs),
            [
                f"{waiting} messages still queued at the kill",
                f"runner gone {runner_gone_s:.1f}s (bound 5s)",
                f"{recovered} jobs requeued by the recovery loop",
                f"all {KILL_9_JOBS} succeeded {drained_s:.0f}s after the kill (bound 90s)",
                "none twice",
            ],
        )
    )


def test_sigterm_with_100_jobs_queued_then_restart_completes_all(
    chaos: Chaos, reliability: Report
) -> None:
    worker = chaos.worker("chaos-term", worker_concurrency=2)
    # Long enough that the two children run few while the rest are sent (8 tokens each: 54
    # had run by then on a loaded machine).
    ids = submit_many(chaos.api, 100, max_tokens=200, ignore_eos=True)
    started = time.monotonic()
    worker.process.send_signal(signal.SIGTERM)
    worker.process.wait(timeout=40)
    stopped_s = time.monotonic() - started
    queued = [j for j in ids if (job := chaos.store.jobs.get(j)) and job.status == "queued"]
    assert len(queued) > 50  # most never started: they waited in Redis
    chaos.worker("chaos-term", worker_concurrency=8)
    jobs = chaos.outcome(ids, timeout_s=90)
    assert [j["status"] for j in jobs.values()].count("succeeded") == 100
    assert all(chaos.done_events(j) == 1 for j in ids)
    reliability.add(
        Case(
            "SIGTERM a worker with 100 jobs queued, start it again",
            100,
            "1 SIGTERM (warm)",
            chaos.lost(jobs),
            [f"worker stopped in {stopped_s:.1f}s", "no job with two results"],
        )
    )


def test_redis_killed_and_restarted_while_jobs_run(chaos: Chaos, reliability: Report) -> None:
    chaos.worker("chaos-redis", worker_concurrency=4)
    ids = submit_many(chaos.api, 12, max_tokens=400, ignore_eos=True)
    wait_until(
        lambda: any((j := chaos.store.jobs.get(i)) and j.status == "running" for i in ids),
        10,
        "a running job",
    )
    chaos.redis.process.send_signal(signal.SIGKILL)
    chaos.redis.process.wait(timeout=5)
    slowest = 0.0
    for method, path, body in [
        ("post", "/v1/jobs", {"prompt": "x"}),
        ("get", f"/v1/jobs/{ids[0]}", None),
        ("get", "/v1/runners", None),
        ("get", "/readyz", None),
    ]:
        started = time.monotonic()
        response = getattr(chaos.api.http, method)(chaos.api.url + path, json=body, timeout=5)
        slowest = max(slowest, time.monotonic() - started)
        assert response.status_code == 503, (path, response.text)
        if path != "/readyz":
            assert response.json()["error"]["type"] == "unavailable"
    assert slowest < 1.0
    assert chaos.api.get("/healthz").status_code == 200
    time.sleep(2)
    restart_redis = start_redis(chaos.processes, chaos.data_dir / "redis", chaos.redis.port)
    chaos.redis = restart_redis
    jobs = chaos.outcome(ids, timeout_s=120)
    for job in jobs.values():
        assert job["status"] == "succeeded" or (job["status"] == "failed" and job["error"])
    after = chaos.api.wait_job(chaos.api.submit(prompt="after", max_tokens=8), timeout_s=60)
    assert after["status"] == "succeeded"
    succeeded = sum(1 for j in jobs.values() if j["status"] == "succeeded")
    reliability.add(
        Case(
            "Redis SIGKILLed for 2 s and restarted (AOF)",
            len(ids),
            "1 SIGKILL (redis-server)",
            chaos.lost(jobs),
            [
                f"API answered 503 within {slowest * 1000:.0f}ms (bound 1s)",
                f"{succeeded}/{len(ids)} succeeded (any other would have to fail with an error)",
                "worker, runner and API reconnected by themselves",
            ],
        )
    )


def test_redis_down_longer_than_a_heartbeat_requeues_and_fails_nothing(
    chaos: Chaos, reliability: Report
) -> None:
    """Every heartbeat expires while Redis is down; when it is back, the hosts that were alive
    all along must not be judged dead before they could beat again."""
    # Two hosts: whichever holds the recovery lease must not judge the other, whose next beat
    # may come up to 2 s after its first sweep.
    hosts = ["chaos-outage-a", "chaos-outage-b"]
    chaos.workers(hosts)
    ids = [
        chaos.api.submit(prompt=f"through {h}", max_tokens=1500, ignore_eos=True, host=h)
        for h in hosts
    ]
    wait_until(lambda: all(chaos.store.streams.streamed_text(j)[1] > 0 for j in ids), 10, "tokens")
    chaos.redis.process.send_signal(signal.SIGKILL)
    chaos.redis.process.wait(timeout=5)
    outage_s = HEARTBEAT_TTL_S + 3
    time.sleep(outage_s)
    chaos.redis = start_redis(chaos.processes, chaos.data_dir / "redis", chaos.redis.port)
    jobs = chaos.outcome(ids, timeout_s=90)
    assert {(j["status"], j["attempts"]) for j in jobs.values()} == {("succeeded", 0)}, jobs
    assert all(chaos.done_events(j) == 1 for j in ids)
    for host in hosts:
        statuses = [change.status for change in chaos.store.runners.history(f"tiny@{host}")]
        assert "Failed" not in statuses, (host, statuses)
    reliability.add(
        Case(
            f"Redis SIGKILLed for {outage_s:.0f} s, longer than a heartbeat lives, and restarted",
            len(ids),
            "1 SIGKILL (redis-server)",
            chaos.lost(jobs),
            ["each running job finished where it ran (not requeued)", "no runner marked failed"],
        )
    )


def test_streaming_clients_get_an_error_when_the_runner_dies(
    chaos: Chaos, reliability: Report
) -> None:
    chaos.worker("chaos-stream")
    ids = submit_many(chaos.api, 5, max_tokens=4000, ignore_eos=True, host="chaos-stream")
    wait_until(lambda: all(chaos.store.streams.streamed_text(i)[1] > 0 for i in ids), 10, "tokens")
    last_events: dict[str, str] = {}
    ended_at: dict[str, float] = {}

    def follow(job_id: str) -> None:
        with requests.get(
            f"{chaos.api.url}/v1/jobs/{job_id}/stream", stream=True, timeout=30
        ) as response:
            for line in response.iter_lines(decode_unicode=True):
                if line.startswith("event: "):
                    last_events[job_id] = line.removeprefix("event: ")
        ended_at[job_id] = time.monotonic()

    readers = [threading.Thread(target=follow, args=(i,), daemon=True) for i in ids]
    for reader in readers:
        reader.start()
    wait_until(lambda: all(i in last_events for i in ids), 10, "every stream to have begun")
    pid = chaos.store.runners.get("tiny@chaos-stream").pid  # type: ignore[union-attr]
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)  # type: ignore[arg-type]
    for reader in readers:
        reader.join(timeout=3)
    assert all(last_events.get(i) == "error" for i in ids), last_events
    slowest = max(ended_at[i] - killed for i in ids)
    assert slowest < 2
    wait_until(
        lambda: (
            (s := chaos.store.runners.get("tiny@chaos-stream"))
            and s.pid != pid
            and s.status == "Ready"
        ),
        30,
        "the runner's restart",
    )
    after = chaos.api.wait_job(chaos.api.submit(prompt="after", max_tokens=8, host="chaos-stream"))
    assert after["status"] == "succeeded"
    reliability.add(
        Case(
            "runner SIGKILLed under 5 streaming clients",
            len(ids) + 1,
            "1 SIGKILL (runner)",
            0,
            [
                f"every stream got `event: error` within {slowest:.2f}s (bound 2s)",
                "job after the restart succeeded",
            ],
        )
    )


def test_a_pickled_message_is_refused_and_logged(chaos: Chaos, reliability: Report) -> None:
    import pickle

    from kombu import Connection

    worker = chaos.worker("chaos-pickle")
    payload = pickle.dumps(((), {}, {}))
    with Connection(chaos.redis.url) as connection:
        producer = connection.Producer()
        producer.publish(
            payload,
            routing_key="exo.host.chaos-pickle",
            exchange="exo.host.chaos-pickle",
            content_type="application/x-python-serialize",
            content_encoding="binary",
            headers={"task": "exo.inference", "id": "pickled", "lang": "py"},
        )
    wait_until(
        lambda: (
            "ContentDisallowed" in worker.log_text()
            or "Refusing to deserialize" in worker.log_text()
        ),
        10,
        "the refusal in the log",
    )
    ok = chaos.api.wait_job(chaos.api.submit(prompt="fine", max_tokens=4, host="chaos-pickle"))
    assert ok["status"] == "succeeded"
    reliability.add(
        Case(
            "a pickled message on a queue",
            1,
            "1 pickle payload",
            0,
            ["refused and logged; the worker kept serving"],
        )
    )


def test_secrets_never_reach_logs_or_error_bodies(
    processes: Processes,
    tiny_model: Path,
    tmp_path: Path,
    reliability: Report,
    caplog: pytest.LogCaptureFixture,
) -> None:
    redis_pass, token, flower_pass = "s3cret-redis-4711", "s3cret-token-4712", "s3cret-flower-4713"
    redis = start_redis(processes, tmp_path / "redis")
    Store.from_url(redis.url).redis.config_set("requirepass", redis_pass)
    url = f"redis://:{redis_pass}@127.0.0.1:{redis.port}/0"
    secrets = {"api_token": token, "flower_basic_auth": f"admin:{flower_pass}"}
    worker = start_worker(processes, url, "chaos-secret", [tiny_model], tmp_path, **secrets)
    wait_runner_ready(Store.from_url(url), worker)
    flower_port = free_port()
    flower = processes.start(
        [EXO_TASKS, "flower"],
        exo_env(redis_url=url, flower_port=flower_port, **secrets),
        tmp_path / "flower.log",
    )
    wait_http(f"http://127.0.0.1:{flower_port}/healthcheck", flower, tmp_path / "flower.log")
    auth = {"Authorization": f"Bearer {token}"}
    with serving(api_settings(url, [tiny_model], api_token=token)) as api:
        created = api.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 4}, headers=auth)
        job_id = created.json()["id"]
        job = wait_until(
            lambda: (
                (j := api.get(f"/v1/jobs/{job_id}", headers=auth).json())["status"] == "succeeded"
                and j
            ),
            30,
            "the job",
        )
        bodies = [
            api.post("/v1/jobs", json={"prompt": 1}, headers=auth).text,
            api.get("/v1/jobs/none", headers=auth).text,
            api.get("/v1/jobs", headers={"Authorization": "Bearer wrong"}).text,
            api.get("/v1/jobs").text,
            requests.get(f"http://127.0.0.1:{flower_port}/api/workers", timeout=5).text,
        ]
    assert job["status"] == "succeeded"
    texts = [
        worker.log_text(),
        (tmp_path / "flower.log").read_text(errors="replace"),
        (tmp_path / "redis" / "redis.log").read_text(),
        caplog.text,
        *bodies,
    ]
    for secret in (redis_pass, token, flower_pass):
        assert not [t for t in texts if secret in t], secret
    reliability.add(
        Case(
            "secrets: Redis password, API token, Flower password",
            1,
            "grep of worker, Flower, Redis and API logs and of error bodies",
            0,
            ["no secret appears in any log line or error body"],
        )
    )
