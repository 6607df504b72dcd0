"""The contenders, each started from nothing and stopped by PID: the exo_tasks stack (its own
redis-server, the API under gunicorn as `exo-tasks api` runs it, one or more workers) and
`python -m mlx_lm server` on the same model directory.

Process handling is the test suite's (`tests/support/`): every process is started in its own
session, remembered with its descendants, and killed by PID.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from exo_tasks.naming import model_slug
from exo_tasks.redis_server import wait_for_redis
from exo_tasks.replication import replicated
from exo_tasks.store import Store, connect
from tests.support.ha import ha_settings, settings_of
from tests.support.processes import (
    EXO_TASKS,
    Processes,
    RedisServer,
    exo_env,
    free_port,
    start_redis,
    wait_until,
)
from tests.support.workers import Worker, start_worker, wait_runner_ready, worker_env

START_TIMEOUT_S = 180.0
# Pool children per worker: a full batch of 32 jobs plus room for control tasks, as by default.
WORKER_CONCURRENCY = 34


class Lab:
    """Every process group the bench starts, so that all of them are stopped by PID at the end,
    even after a failure or Ctrl-C; each group gets its own directory for logs and data."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._groups: list[Processes] = []
        self._started = 0

    def group(self, name: str) -> tuple[Processes, Path]:
        self._started += 1
        directory = self.workdir / f"{self._started:02d}-{name}"
        directory.mkdir(parents=True, exist_ok=True)
        processes = Processes()
        self._groups.append(processes)
        return processes, directory

    def stop(self, processes: Processes) -> None:
        if processes in self._groups:
            self._groups.remove(processes)
            processes.stop_all()

    def close(self) -> None:
        for processes in reversed(list(self._groups)):
            self.stop(processes)


def _get_ok(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


@dataclass
class ExoStack:
    url: str
    model: str
    redis: RedisServer
    store: Store
    workers: list[Worker]
    processes: Processes
    directory: Path


def start_exo(
    lab: Lab, name: str, model_dir: Path, *, workers: int = 1, **settings: Any
) -> ExoStack:
    """Redis, the API and `workers` workers serving `model_dir`; returns once every runner is
    Ready and the API answers. `settings` become EXO_* variables of the API and the workers;
    with `redis_ha`, Redis runs as `exo-tasks up --ha` runs it (a master, its replica, three
    Sentinels) and the API and the workers find it through the Sentinels."""
    processes, directory = lab.group(name)
    if settings.pop("redis_ha", False):  # they share its data dir (the password), its ports
        redis, pointers = start_ha_redis(processes, directory)
        settings.update(pointers)
        redis_url = ""  # no EXO_REDIS_URL: the Sentinels say where the master is
    else:
        redis = start_redis(processes, directory / "redis")
        redis_url = redis.url
    port = free_port()
    settings.setdefault("worker_concurrency", WORKER_CONCURRENCY)
    api_env = worker_env(redis_url, "api", [model_dir], directory, api_port=port, **settings)
    processes.start([EXO_TASKS, "api"], api_env, directory / "api.log")
    started = [
        start_worker(processes, redis_url, f"bench{i}", [model_dir], directory, **settings)
        for i in range(workers)
    ]
    store = Store.from_url(redis.url)
    model = model_slug(str(model_dir))
    for worker in started:
        wait_runner_ready(store, worker, model=model, timeout_s=START_TIMEOUT_S)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _get_ok(f"{url}/readyz"), START_TIMEOUT_S, "the exo_tasks API")
    return ExoStack(url, model, redis, store, started, processes, directory)


def start_ha_redis(processes: Processes, directory: Path) -> tuple[RedisServer, dict[str, Any]]:
    """`exo-tasks redis` with EXO_REDIS_HA, its data in `directory`; returns once the master
    has its replica (before that a 202 would not wait for one): the Redis (`url`: through the
    Sentinels) and the settings that point the API and the workers at it."""
    values = ha_settings(directory)
    process = processes.start([EXO_TASKS, "redis"], exo_env(**values), directory / "redis.log")
    settings = settings_of(values)
    url = settings.effective_redis_url
    wait_for_redis(url, timeout_s=START_TIMEOUT_S)
    client = connect(url)
    wait_until(lambda: replicated(client, 1000), START_TIMEOUT_S, "the HA Redis's replica")
    pointers = {name: value for name, value in values.items() if name != "data_dir"}
    return RedisServer(url=url, port=settings.redis_port, process=process), pointers


@dataclass
class MlxServer:
    url: str
    processes: Processes


def start_mlx_server(lab: Lab, name: str, model_dir: Path, ranks: int = 1) -> MlxServer:
    """`python -m mlx_lm server --model DIR`, or with `ranks` > 1 as mlx-lm runs it
    distributed, `mlx.launch --backend ring -n RANKS ... mlx_lm.server`; returns once /health
    answers 200."""
    processes, directory = lab.group(name)
    port = free_port()
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir)]
    if ranks > 1:
        bin_dir = Path(sys.executable).parent
        argv = [str(bin_dir / "mlx.launch"), "--backend", "ring", "-n", str(ranks)]
        argv += ["--starting-port", str(free_port()), "--python", sys.executable, "--"]
        argv += [str(bin_dir / "mlx_lm.server"), "--model", str(model_dir)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = processes.start(argv, env, directory / "mlx.log")
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"mlx_lm.server exited ({process.returncode}); see {directory}")
        return _get_ok(f"{url}/health")

    wait_until(healthy, START_TIMEOUT_S, "mlx_lm.server", interval_s=0.1)
    return MlxServer(url, processes)
