"""Runner status as published to Redis and served by the API; readiness."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from exo_tasks.fleet_types import RunnerState, RunnerStatus
from tests.support.api import api_settings, serving
from tests.support.processes import Processes, free_port, wait_until
from tests.support.stack import Stack
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

    def back_to_ready() -> dict[str, Any] | None:
        # The job's ending is written a moment before the runner says it is Ready again.
        runner: dict[str, Any] = stack.api.get("/v1/runners/tiny@host-h").json()
        return runner if runner["history"][-1]["status"] == "Ready" else None

    runner = wait_until(back_to_ready, 5, "the runner Ready again")
    statuses = [change["status"] for change in runner["history"]]
    assert statuses[:5] == ["WaitingForModel", "Loading", "Loaded", "WarmingUp", "Ready"]
    assert "Running" in statuses[5:]
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


def test_loading_a_runner_on_a_host_with_no_live_worker_is_404_naming_it(stack: Stack) -> None:
    """It was 202: a dead host's runner, left `Failed` in Redis, looked loadable, and the load
    task waited in a queue no worker reads."""
    dead = RunnerState(
        id="tiny@gone-host", host="gone-host", model="tiny", status=RunnerStatus.FAILED
    )
    stack.store.runners.publish(dead)
    for host in ("gone-host", "never-was"):
        response = stack.api.post("/v1/runners", json={"model": "tiny", "host": host})
        assert response.status_code == 404, response.text
        error = response.json()["error"]
        assert error["details"] == {"field": "host"}
        assert error["message"] == f"host '{host}' has no live worker"
    # Nor is it picked when no host is named: the live host's runner is up, so 409.
    response = stack.api.post("/v1/runners", json={"model": "tiny"})
    assert response.status_code == 409 and "tiny@host-a" in response.json()["error"]["message"]
