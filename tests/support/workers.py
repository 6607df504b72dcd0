"""Workers for tests and benchmarks: `exo-tasks worker` on a host name of the test's choosing,
and the waits for its runners."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from exo_tasks.fleet_types import RunnerState, RunnerStatus
from exo_tasks.naming import model_slug, runner_id_for
from exo_tasks.store import Store
from tests.support.processes import EXO_TASKS, Processes, wait_until


@dataclass
class Worker:
    host: str
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def pool_children(worker: Worker) -> list[psutil.Process]:
    """The worker's pool children: forks of its main process (same command line), less the
    batch feeder; the runner and multiprocessing's resource tracker are spawned."""
    main = psutil.Process(worker.process.pid)
    return [
        child
        for child in main.children()
        if child.cmdline() == main.cmdline() and child.name() != "exo-feeder"
    ]


def worker_env(
    redis_url: str, host: str, models: list[Path], data_dir: Path, **overrides: Any
) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "EXO_REDIS_URL": redis_url,
            "EXO_HOSTNAME": host,
            "EXO_MODELS": ",".join(str(m) for m in models),
            "EXO_DATA_DIR": str(data_dir),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update({f"EXO_{k.upper()}": str(v) for k, v in overrides.items()})
    return env


def start_worker(
    processes: Processes,
    redis_url: str,
    host: str,
    models: list[Path],
    data_dir: Path,
    **overrides: Any,
) -> Worker:
    env = worker_env(redis_url, host, models, data_dir, **overrides)
    log_path = data_dir / f"worker-{host}.log"
    proc = processes.start([EXO_TASKS, "worker"], env, log_path)
    return Worker(host=host, env=env, log_path=log_path, process=proc)


def wait_runner_ready(
    store: Store, worker: Worker, model: str = "tiny", timeout_s: float = 90
) -> RunnerState:
    runner_id = runner_id_for(model, worker.host)

    def ready() -> RunnerState | None:
        if worker.process.poll() is not None:
            raise AssertionError(
                f"worker exited ({worker.process.returncode}):\n{worker.log_text()[-4000:]}"
            )
        state = store.runners.get(runner_id)
        return state if state is not None and state.status.accepts_jobs else None

    state: RunnerState = wait_until(ready, timeout_s, f"runner {runner_id} Ready")
    return state


def new_worker(
    processes: Processes,
    redis_url: str,
    store: Store,
    host: str,
    models: list[Path],
    data_dir: Path,
    **settings: Any,
) -> Worker:
    """The one worker factory: started, and waited for until its first model's runner takes
    jobs (that model's slug is its directory's name)."""
    worker = start_worker(processes, redis_url, host, models, data_dir, **settings)
    wait_runner_ready(store, worker, model_slug(str(models[0])))
    return worker


def runner_state(store: Store, host: str, model: str = "tiny") -> RunnerState:
    state = store.runners.get(runner_id_for(model, host))
    assert state is not None
    return state


def wait_runner(
    store: Store, host: str, status: RunnerStatus | str, timeout_s: float, model: str = "tiny"
) -> RunnerState:
    state: RunnerState = wait_until(
        lambda: (s := runner_state(store, host, model)).status == status and s,
        timeout_s,
        f"runner {runner_id_for(model, host)} {status}",
    )
    return state
