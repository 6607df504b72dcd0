"""The whole local stack as users start it: `exo-tasks up` (or `honcho start` on the Procfile)
from its own data dir and ports, in the background or in a real terminal."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import requests

from exo_tasks.modelgen import MAX_LENGTH
from exo_tasks.store import Store
from tests.support.processes import (
    EXO_TASKS,
    Processes,
    embedded_redis_url,
    exo_env,
    free_port,
    wait_http,
    wait_until,
)
from tests.support.terminal import Terminal

HOST = "stack-host"
# Jobs that no stop lets finish, the model's whole length: the worker's drain (1 s), the
# seconds before a SIGKILLed launcher's processes see it gone, and the time the first jobs run
# while the pool grows for the last (2.8 s on CI) each ended 1,500-token jobs (succeeded,
# rightly, where the tests wanted them requeued).
LONG_TOKENS = MAX_LENGTH - 64
LONG_JOB = {"prompt": "long", "max_tokens": LONG_TOKENS, "ignore_eos": True}
JOBS = 4


def launcher_env(data_dir: Path, **settings: Any) -> dict[str, str]:
    """Free ports, its own data dir, one API worker; `settings` on top, as EXO_ variables."""
    env = exo_env(
        **{
            "api_port": free_port(),
            "flower_port": free_port(),
            "redis_port": free_port(),
            "data_dir": data_dir,
            "hostname": HOST,
            "worker_concurrency": 8,
            "api_workers": 1,
            **settings,
        }
    )
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class LocalStack:
    """A stack run by `exo-tasks up` (or honcho) from its own data dir and ports."""

    processes: Processes
    data_dir: Path
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    terminal: Terminal | None = None

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.env['EXO_API_PORT']}"

    @property
    def redis_port(self) -> int:
        return int(self.env["EXO_REDIS_PORT"])

    def start(
        self, argv: list[str], ready: str = "/readyz", cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        self.process = self.processes.start(argv, self.env, self.log_path, cwd)
        wait_http(self.api + ready, self.process, self.log_path, timeout_s=90)
        return self.process

    def up(self) -> subprocess.Popen[bytes]:
        return self.start([EXO_TASKS, "up"])

    def up_in_terminal(self) -> Terminal:
        """`exo-tasks up` as in a terminal: a pty is its controlling terminal."""
        self.terminal = Terminal(self.processes, [EXO_TASKS, "up"], self.env, self.log_path)
        self.process = self.terminal.process
        wait_http(self.api + "/readyz", self.process, self.log_path, timeout_s=90)
        return self.terminal

    def store(self) -> Store:
        return Store.from_url(embedded_redis_url(self.data_dir / "redis", self.redis_port))

    def submit_long_jobs(self, max_tokens: int = LONG_TOKENS) -> list[str]:
        """JOBS long jobs, returned once every one streams tokens."""
        job = {**LONG_JOB, "max_tokens": max_tokens}
        ids = [
            requests.post(f"{self.api}/v1/jobs", json=job, timeout=10).json()["id"]
            for _ in range(JOBS)
        ]
        store = self.store()
        wait_until(
            lambda: all(store.streams.streamed_text(j)[1] >= 3 for j in ids),
            20,
            "tokens of every job",
        )
        return ids

    def job(self, job_id: str) -> dict[str, Any]:
        job: dict[str, Any] = requests.get(f"{self.api}/v1/jobs/{job_id}", timeout=5).json()
        return job

    def all_succeeded(self, ids: list[str]) -> bool:
        """For a wait: whether every job succeeded. A read that times out counts as not yet:
        a stack just started, on a loaded machine, can take over 5 s to answer its first
        requests while its runner loads the model and starts the requeued jobs."""
        try:
            return all(self.job(j)["status"] == "succeeded" for j in ids)
        except requests.Timeout:
            return False

    def tree(self) -> list[psutil.Process]:
        """The launcher and every process under it, taken before a stop."""
        assert self.process is not None
        root = psutil.Process(self.process.pid)
        tree = [root, *root.children(recursive=True)]
        self.processes.extra_pids.update(p.pid for p in tree)  # stopped at teardown, orphans too
        return tree

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")
