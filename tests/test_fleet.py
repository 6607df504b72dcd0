"""Several hosts on one Redis: routing by model and by host, liveness, queue depths, priorities
and the queue cap. Hosts are real `exo-tasks worker` processes with their own EXO_HOSTNAME."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from exo_tasks.modelgen import create_model
from tests.conftest import Stack, TwoHosts
from tests.support.api import Api, api_settings, serving
from tests.support.processes import Processes, wait_until
from tests.support.workers import start_worker, wait_runner_ready

LONG_ON_X = {
    "prompt": "long",
    "max_tokens": 4000,
    "ignore_eos": True,
    "model": "alpha",
    "host": "fleet-x",
}


@contextmanager
def x_busy(api: Api) -> Iterator[str]:
    """fleet-x's only pool child runs a long job (cancelled on the way out), so every other
    job pinned to fleet-x waits in its host queue."""
    job_id = api.submit(**LONG_ON_X)
    try:
        wait_until(lambda: api.get(f"/v1/jobs/{job_id}").json()["status"] == "running", 30, "x")
        yield job_id
    finally:
        api.post(f"/v1/jobs/{job_id}/cancel")
        api.wait_job(job_id)


def cancel_all(api: Api, job_ids: list[str]) -> None:
    for job_id in job_ids:
        api.post(f"/v1/jobs/{job_id}/cancel")


def test_jobs_run_on_a_live_host_that_serves_their_model(stack: Stack, fleet: TwoHosts) -> None:
    beta = stack.api.wait_job(stack.api.submit(prompt="b", max_tokens=4, model="beta"))
    assert beta["status"] == "succeeded"
    assert beta["host"] == "fleet-y" and beta["runner_id"] == "beta@fleet-y"
    alpha = [stack.api.submit(prompt=f"a{i}", max_tokens=4, model="alpha") for i in range(4)]
    assert {stack.api.wait_job(j)["host"] for j in alpha} <= {"fleet-x", "fleet-y"}
    pinned = stack.api.wait_job(
        stack.api.submit(prompt="p", max_tokens=4, model="alpha", host="fleet-x")
    )
    assert pinned["status"] == "succeeded" and pinned["runner_id"] == "alpha@fleet-x"


def test_an_unpinned_job_does_not_wait_behind_a_busy_host(stack: Stack, fleet: TwoHosts) -> None:
    with x_busy(stack.api) as long_id:
        started = time.monotonic()
        job = stack.api.wait_job(stack.api.submit(prompt="quick", max_tokens=8, model="alpha"))
        assert job["status"] == "succeeded" and job["host"] == "fleet-y"
        assert time.monotonic() - started < 10
        assert stack.api.get(f"/v1/jobs/{long_id}").json()["status"] == "running"


def test_a_model_no_live_host_serves_is_404_naming_the_served_models(
    stack: Stack, fleet: TwoHosts
) -> None:
    before = stack.store.redis.zcard("exo:jobs")
    response = stack.api.post("/v1/jobs", json={"prompt": "a", "model": "no-such-model"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert "no-such-model" in error["message"] and "not served by any live host" in error["message"]
    assert {"alpha", "beta", "tiny"} <= set(error["details"]["served_models"])
    assert all(m in error["message"] for m in ("alpha", "beta", "tiny"))
    assert stack.store.redis.zcard("exo:jobs") == before


def test_pinning_to_a_host_without_the_model_is_404(stack: Stack, fleet: TwoHosts) -> None:
    response = stack.api.post("/v1/jobs", json={"prompt": "a", "model": "beta", "host": "fleet-x"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["details"]["field"] == "host"
    assert "fleet-x" in error["message"] and "beta" in error["message"]


def test_a_stopped_runner_is_503_and_a_stopped_host_is_404(
    stack: Stack, processes: Processes, tmp_path: Path
) -> None:
    delta = create_model("tiny", tmp_path / "delta")
    worker = start_worker(processes, stack.redis.url, "fleet-z", [delta], tmp_path)
    wait_runner_ready(stack.store, worker, "delta")
    api = stack.api
    assert api.wait_job(api.submit(prompt="d", max_tokens=4, model="delta"))["host"] == "fleet-z"

    assert api.post("/v1/runners/delta@fleet-z/shutdown", json={"mode": "hard"}).status_code == 202
    wait_until(
        lambda: api.get("/v1/runners/delta@fleet-z").json()["status"] == "Shutdown", 10, "stop"
    )
    down = api.post("/v1/jobs", json={"prompt": "d", "model": "delta"})
    assert down.status_code == 503
    assert "every runner for model 'delta' is down" in down.json()["error"]["message"]

    assert api.post("/v1/runners", json={"model": "delta"}).status_code == 202
    wait_runner_ready(stack.store, worker, "delta")
    assert api.wait_job(api.submit(prompt="d", max_tokens=4, model="delta"))["status"] == (
        "succeeded"
    )

    assert api.post("/v1/hosts/fleet-z/shutdown", json={"mode": "warm"}).status_code == 202
    worker.process.wait(timeout=30)
    gone = api.post("/v1/jobs", json={"prompt": "d", "model": "delta"})
    assert gone.status_code == 404
    assert "delta" not in gone.json()["error"]["details"]["served_models"]


def host_entry(api: Api, name: str) -> dict[str, Any]:
    hosts: dict[str, dict[str, Any]] = {h["name"]: h for h in api.get("/v1/hosts").json()}
    assert name in hosts, sorted(hosts)
    return hosts[name]


def test_hosts_lists_live_workers_with_pid_runners_and_queue_depths(
    stack: Stack, fleet: TwoHosts
) -> None:
    started = time.monotonic()
    hosts = {h["name"]: h for h in stack.api.get("/v1/hosts").json()}
    assert time.monotonic() - started < 3
    assert {"host-a", "fleet-x", "fleet-y"} <= set(hosts)
    x, y = hosts["fleet-x"], hosts["fleet-y"]
    assert x["node"] == "exo@fleet-x" and x["pid"] == fleet.x.pid and x["concurrency"] == 1
    assert y["pid"] == fleet.y.pid and y["models"] == ["alpha", "beta"]
    assert [r["id"] for r in x["runners"]] == ["alpha@fleet-x"]
    assert {r["id"] for r in y["runners"]} == {"alpha@fleet-y", "beta@fleet-y"}
    assert set(x["queues"]) == {"exo.host.fleet-x", "exo.model.alpha"}
    with x_busy(stack.api):
        queued = [stack.api.submit(**LONG_ON_X) for _ in range(2)]
        try:
            assert host_entry(stack.api, "fleet-x")["queues"]["exo.host.fleet-x"] == 2
        finally:
            cancel_all(stack.api, queued)


def test_a_full_queue_is_429_with_retry_after(
    stack: Stack, fleet: TwoHosts, tmp_path: Path
) -> None:
    queued: list[str] = []
    settings = api_settings(stack.redis.url, [tmp_path / "alpha"], max_queued_jobs=2)
    with serving(settings) as api, x_busy(api):
        try:
            queued = [api.submit(**LONG_ON_X) for _ in range(2)]
            full = api.post("/v1/jobs", json=LONG_ON_X)
            assert full.status_code == 429
            assert full.headers["Retry-After"] == "5"
            error = full.json()["error"]
            assert error["type"] == "queue_full" and "EXO_MAX_QUEUED_JOBS=2" in error["message"]
            assert error["details"] == {"retry_after_s": 5}
            # Another queue is not full: an unpinned job is still taken.
            other = api.post("/v1/jobs", json={"prompt": "b", "max_tokens": 2, "model": "beta"})
            assert other.status_code == 202
        finally:
            cancel_all(api, queued)


def test_a_high_priority_job_overtakes_queued_normal_ones(stack: Stack, fleet: TwoHosts) -> None:
    short = {**LONG_ON_X, "max_tokens": 4}
    with x_busy(stack.api):
        low = stack.api.submit(**short, priority="low")
        normal = [stack.api.submit(**short) for _ in range(3)]
        high = stack.api.submit(**short, priority="high")
    jobs = {j: stack.api.wait_job(j) for j in [low, *normal, high]}
    assert all(job["status"] == "succeeded" for job in jobs.values())
    started = {j: job["started_at"] for j, job in jobs.items()}
    assert started[high] < min(started[n] for n in normal)
    assert max(started[n] for n in normal) < started[low]
