"""Runner status as published to Redis and served by the API; readiness."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import Stack
from tests.support.api import api_settings, serving
from tests.support.processes import Processes, free_port
from tests.support.workers import start_worker, wait_runner_ready


def test_runners_list_shows_status_pid_host_and_model(stack: Stack) -> None:
    runners = {r["id"]: r for r in stack.api.get("/v1/runners").json()}
    runner = runners["tiny@host-a"]
    assert runner["status"] in ("Ready", "Running")
    assert runner["host"] == "host-a" and runner["model"] == "tiny"
    assert runner["pid"] > 0 and runner["pid"] != stack.worker.pid
    assert runner["error"] is None


def test_runner_history_walks_the_lifecycle(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    worker = start_worker(processes, stack.redis.url, "host-h", [tiny_model], tmp_path)
    wait_runner_ready(stack.store, worker)
    job_id = stack.api.submit(prompt="history", max_tokens=4, host="host-h")
    assert stack.api.wait_job(job_id)["status"] == "succeeded"
    runner = stack.api.get("/v1/runners/tiny@host-h").json()
    statuses = [change["status"] for change in runner["history"]]
    assert statuses[:5] == ["WaitingForModel", "Loading", "Loaded", "WarmingUp", "Ready"]
    assert "Running" in statuses[5:]
    assert statuses[-1] == "Ready"
    times = [change["at"] for change in runner["history"]]
    assert times == sorted(times)


def test_readyz_is_200_with_a_ready_runner(stack: Stack) -> None:
    response = stack.api.get("/readyz")
    assert response.status_code == 200
    assert "tiny@host-a" in response.json()["ready_runners"]
    assert stack.api.get("/healthz").json() == {"status": "ok"}


def test_readyz_is_503_without_a_ready_runner(stack: Stack, tiny_model: Path) -> None:
    empty_db = stack.redis.url.rsplit("/", 1)[0] + "/7"
    with serving(api_settings(empty_db, [tiny_model])) as api:
        response = api.get("/readyz")
        assert response.status_code == 503
        assert response.json()["redis"] is True and response.json()["ready_runners"] == []


def test_readyz_and_jobs_are_503_when_redis_is_unreachable(tiny_model: Path) -> None:
    with serving(api_settings(f"redis://127.0.0.1:{free_port()}/0", [tiny_model])) as api:
        assert api.get("/readyz").status_code == 503
        assert api.get("/healthz").status_code == 200
        response = api.post("/v1/jobs", json={"prompt": "a"})
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "unavailable"


def test_the_embedded_redis_listens_on_loopback_only_with_aof(stack: Stack) -> None:
    config = stack.store.redis.config_get("*")
    assert config["bind"] == "127.0.0.1"
    assert config["appendonly"] == "yes"
