"""The shared stack as tests see it (one host on the session's Redis, and the API), the two
hosts of the fleet, and the helpers for tests that run a worker of their own beside them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exo_tasks.naming import host_queue, runner_id_for
from exo_tasks.store import Store
from tests.support import workers
from tests.support.api import Api
from tests.support.processes import Processes, RedisServer, wait_until
from tests.support.workers import Worker

LONG = {"prompt": "long", "max_tokens": 4000, "ignore_eos": True}


@dataclass
class Stack:
    redis: RedisServer
    store: Store
    worker: Worker
    api: Api


@dataclass
class TwoHosts:
    """Two more hosts on the session's Redis: x serves alpha with one pool child (a job pinned
    there waits its turn), y serves alpha and beta. Both models are the tiny one, renamed."""

    x: Worker
    y: Worker


def wait_tokens(stack: Stack, job_id: str, at_least: int = 3) -> None:
    wait_until(
        lambda: stack.store.streams.streamed_text(job_id)[1] >= at_least,
        10,
        f"tokens of job {job_id}",
    )


def idle(stack: Stack, worker: Worker) -> Worker:
    """`worker`, once no job of an earlier test is on its tiny runner or in its host's queue:
    for a host a module's tests share."""

    def quiet() -> bool:
        state = stack.store.runners.get(runner_id_for("tiny", worker.host))
        busy = state is None or state.active_jobs > 0
        return not busy and stack.store.jobs.queue_depth(host_queue(worker.host)) == 0

    wait_until(quiet, 30, f"{worker.host} idle")
    return worker


def new_worker(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path, host: str, **settings: Any
) -> Worker:
    """A worker of a test's own on the session's Redis, serving the tiny model, ready."""
    return workers.new_worker(
        processes, stack.redis.url, stack.store, host, [tiny_model], tmp_path, **settings
    )
