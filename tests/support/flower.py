"""Flower as `exo-tasks flower` runs it, with basic auth, beside the shared stack and the fleet:
its HTTP API and pages as the tests read them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from tests.support.processes import EXO_TASKS, Processes, exo_env, free_port, wait_until
from tests.support.stack import Stack

AUTH = ("admin", "s3cret")


@dataclass
class Flower:
    url: str
    process: Any
    log_path: Path

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        assert self.process.poll() is None, self.log_path.read_text()[-2000:]
        return requests.get(self.url + path, timeout=10, **kwargs)

    def tasks(self, **params: Any) -> dict[str, Any]:
        tasks: dict[str, Any] = self.get("/api/tasks", auth=AUTH, params=params).json()
        return tasks

    def task(self, task_id: str) -> dict[str, Any]:
        """Flower's info on the task; empty until Flower has its first event (a 404 till then)."""
        response = self.get(f"/api/task/info/{task_id}", auth=AUTH)
        if response.status_code == 404:
            return {}
        info: dict[str, Any] = response.json()
        return info

    def left_state(self, task_id: str, state: str) -> bool:
        return self.task(task_id).get("state") != state

    def wait_state(self, task_id: str, state: str, timeout_s: float = 15) -> dict[str, Any]:
        info: dict[str, Any] = wait_until(
            lambda: (i := self.task(task_id)).get("state") == state and i,
            timeout_s,
            f"Flower to show task {task_id} {state}",
            interval_s=0.2,
        )
        return info

    def revoke(self, task_id: str, **params: str) -> None:
        response = requests.post(
            f"{self.url}/api/task/revoke/{task_id}", params=params, auth=AUTH, timeout=10
        )
        assert response.status_code == 200, response.text


def running_flower(stack: Stack, data_dir: Path, workers: tuple[str, ...]) -> Iterator[Flower]:
    """Flower on the stack's Redis, once it sees `workers` online and knows their queues;
    stopped after."""
    processes = Processes()
    port = free_port()
    env = exo_env(
        redis_url=stack.redis.url,
        flower_port=port,
        flower_basic_auth=":".join(AUTH),
        data_dir=data_dir,
    )
    log_path = data_dir / "flower.log"
    process = processes.start([EXO_TASKS, "flower"], env, log_path)
    flower = Flower(f"http://127.0.0.1:{port}", process, log_path)

    def online() -> dict[str, bool] | None:
        try:
            alive: dict[str, bool] = flower.get("/api/workers?status=1", auth=AUTH).json()
        except (requests.ConnectionError, requests.Timeout):  # not up, or still starting
            return None
        # Seen through worker heartbeat events: Flower's event receiver is running.
        return alive if all(alive.get(worker) for worker in workers) else None

    def knows_queues() -> bool:
        # From Flower's own inspection, which may come later under load: its Broker page
        # (/api/queues/length) lists only the queues it read there.
        known: dict[str, dict[str, Any]] = flower.get("/api/workers", auth=AUTH).json()
        return all(known.get(worker, {}).get("active_queues") for worker in workers)

    try:
        wait_until(online, 30, "Flower to see the workers online", interval_s=0.3)
        wait_until(knows_queues, 30, "Flower to know the workers' queues", interval_s=0.3)
        yield flower
    finally:
        processes.stop_all()
