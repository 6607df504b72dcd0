"""Flower, as `exo-tasks flower` runs it: basic auth, both hosts' workers, and inference tasks
with their PROGRESS (tokens done of max) and their end."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import psutil
import requests
from celery.result import AsyncResult

from tests.conftest import Stack, TwoHosts
from tests.stack import EXO_TASKS, Processes, exo_env, free_port, wait_until

AUTH = ("admin", "s3cret")


def test_flower_shows_workers_and_task_progress_behind_basic_auth(
    stack: Stack, fleet: TwoHosts, processes: Processes, tmp_path: Path
) -> None:
    port = free_port()
    env = exo_env(
        redis_url=stack.redis.url,
        flower_port=port,
        flower_basic_auth=":".join(AUTH),
        data_dir=tmp_path,
    )
    flower = processes.start([EXO_TASKS, "flower"], env, tmp_path / "flower.log")
    url = f"http://127.0.0.1:{port}"

    def get(path: str, **kwargs: Any) -> requests.Response:
        assert flower.poll() is None, (tmp_path / "flower.log").read_text()[-2000:]
        return requests.get(url + path, timeout=10, **kwargs)

    def online() -> dict[str, bool] | None:
        try:
            alive: dict[str, bool] = get("/api/workers?status=1", auth=AUTH).json()
        except (requests.ConnectionError, requests.Timeout):  # not up, or still starting
            return None
        # Seen through worker heartbeat events: Flower's event receiver is running.
        return alive if alive.get("exo@fleet-x") and alive.get("exo@fleet-y") else None

    wait_until(online, 30, "Flower to see both workers online", interval_s=0.3)
    assert get("/api/workers").status_code == 401
    # The password is given by environment: a command line is visible to every local user.
    assert AUTH[1] not in " ".join(psutil.Process(flower.pid).cmdline())
    assert get("/api/tasks", auth=("admin", "wrong")).status_code == 401
    workers = get("/api/workers?refresh=1", auth=AUTH).json()
    assert {"exo@fleet-x", "exo@fleet-y"} <= set(workers)
    assert workers["exo@fleet-x"]["stats"]["pool"]["max-concurrency"] == 1

    long_id = stack.api.submit(prompt="long", max_tokens=4000, ignore_eos=True, model="beta")
    try:
        info: dict[str, Any] = wait_until(
            lambda: (
                (i := get(f"/api/task/info/{long_id}", auth=AUTH).json()).get("state") == "PROGRESS"
                and i
            ),
            15,
            "Flower to show the task's progress",
            interval_s=0.2,
        )
        progress = ast.literal_eval(info["result"])
        assert progress["max_tokens"] == 4000 and 0 < progress["tokens"] < 4000
        assert info["worker"] == "exo@fleet-y" and info["name"] == "exo.inference"
        result: AsyncResult[Any] = AsyncResult(long_id, app=stack.api.app.extensions["exo"].celery)
        assert str(result.state) == "PROGRESS" and result.info["max_tokens"] == 4000
    finally:
        stack.api.post(f"/v1/jobs/{long_id}/cancel")

    short_id = stack.api.submit(prompt="short", max_tokens=8, model="beta")
    assert stack.api.wait_job(short_id)["status"] == "succeeded"

    def finished() -> dict[str, Any] | None:
        tasks: dict[str, Any] = get("/api/tasks", auth=AUTH).json()
        task = tasks.get(short_id)
        return task if task is not None and task["state"] == "SUCCESS" else None

    task = wait_until(finished, 15, "Flower to list the finished task", interval_s=0.2)
    assert task["name"] == "exo.inference" and task["worker"] == "exo@fleet-y"
    assert "'status': 'succeeded'" in task["result"]
