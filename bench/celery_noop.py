"""A bare Celery round trip, what the queue itself costs: a no-op task on the stack's Redis
(broker and result backend, with the project's Celery settings), served by a prefork worker of
its own and awaited by the bench with `apply_async(...).get()`.

`celery -A bench.celery_noop worker` serves it (EXO_REDIS_URL names the stack's Redis).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from celery import Celery

from config.celery import celery_config
from config.settings import Settings
from tests.support.processes import Processes, wait_until

QUEUE = "bench.noop"


def make_app(redis_url: str) -> Celery:
    app = Celery("bench_noop")
    app.config_from_object(celery_config(Settings(redis_url=redis_url, _env_file=None)))
    app.conf.task_default_queue = QUEUE
    return app


app = make_app(os.environ.get("EXO_REDIS_URL", "redis://127.0.0.1:6379/0"))


@app.task(name="bench.noop")
def noop() -> None:
    """Nothing: the round trip is all there is."""


def start_worker(processes: Processes, redis_url: str, log_path: Path) -> None:
    """One pool child (the bench sends one task at a time), ready to take the task."""
    argv = [sys.executable, "-m", "celery", "-A", "bench.celery_noop", "worker"]
    argv += ["-Q", QUEUE, "-c", "1", "-n", f"noop{os.getpid()}@%h", "--loglevel", "WARNING"]
    env = {**os.environ, "EXO_REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"}
    processes.start(argv, env, log_path, cwd=Path(__file__).resolve().parent.parent)
    sender = make_app(redis_url)
    wait_until(lambda: sender.control.ping(timeout=1.0), 120, "the no-op Celery worker")


def round_trips_ms(redis_url: str, count: int) -> list[float]:
    """`count` no-op tasks one after another: each sent and its result awaited, in ms."""
    sender = make_app(redis_url)
    task = sender.signature("bench.noop")
    took = []
    for _ in range(count):
        started = time.perf_counter()
        task.apply_async().get(timeout=60)
        took.append((time.perf_counter() - started) * 1000)
    return took
