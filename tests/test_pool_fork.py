"""A pool child forked while one of the worker's threads is inside a Redis call can still use
Redis. Celery forks its pool children after the heartbeat, recovery and supervisor threads
started; a child that inherited the Redis pool's lock held by one of them waited for ever on
its first job (seen in the chaos suite: a job received, never started, for six minutes).
And the batch feeder is forked from the worker too, not a new interpreter, and what the
worker's main process holds, which all it forks shares, is what a worker needs."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
from celery.signals import worker_process_init

from exo_tasks.celery_app import ExoCelery
from exo_tasks.worker.app import create_worker_app
from tests.support.api import api_settings
from tests.support.processes import RedisServer
from tests.support.stack import Stack

FORKS = 300
THREADS = 4
CHILD_BOUND_S = 10.0
# Libraries the worker's main process would map if it imported them: the `celery` command's
# other commands and plugins (Tornado's for Flower, wcwidth's and curses for the shells), ~11
# MiB; numpy and the tokenizer's library, the runner's, ~10 MiB.
NOT_MAPPED = ("speedups.abi3", "_wcwidth_c", "_curses", "_multiarray_umath", "tokenizers.abi3")


def _run_child(app: ExoCelery) -> None:
    """In the forked child: what Celery's pool child does before its first task, then one
    Redis round trip. Never returns."""
    code = 1
    try:
        worker_process_init.send(sender=None)
        app.store.redis.ping()
        code = 0
    finally:
        os._exit(code)  # never back into pytest


def _exits_within(children: list[int], bound_s: float) -> dict[int, int | None]:
    """Each child's exit code, None for those still running after `bound_s`."""
    deadline = time.monotonic() + bound_s
    exits: dict[int, int | None] = dict.fromkeys(children)
    while time.monotonic() < deadline and None in exits.values():
        for pid in [p for p, code in exits.items() if code is None]:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                exits[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    return exits


def test_a_pool_child_forked_while_a_thread_uses_redis_gets_an_answer(
    redis_server: RedisServer,
) -> None:
    app = create_worker_app(api_settings(redis_server.url, []))
    app.set_current()  # as the worker does before its pool forks
    app.prepare_forks()  # and this: the store its children take
    busy = threading.Event()

    def use_redis() -> None:
        while not busy.is_set():
            app.store.redis.ping()

    # Several threads, as in the worker: more of the time one of them holds the pool's lock.
    threads = [threading.Thread(target=use_redis, daemon=True) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    children: list[int] = []
    try:
        for _ in range(FORKS):
            pid = os.fork()
            if pid == 0:
                _run_child(app)
            children.append(pid)
            time.sleep(0.002)
    finally:
        busy.set()
        for thread in threads:
            thread.join()

    exits = _exits_within(children, CHILD_BOUND_S)
    hung = [pid for pid, code in exits.items() if code is None]
    for pid in hung:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert not hung, f"{len(hung)} of {FORKS} children never got Redis's answer"
    assert set(exits.values()) == {0}


def test_the_batch_feeder_is_forked_from_the_worker(stack: Stack) -> None:
    # Forked, it shares the worker's imports: ~14 MiB (PSS); a spawned interpreter held 50.
    worker = psutil.Process(stack.worker.pid)
    names = {child.pid: child.name() for child in worker.children()}
    feeders = [pid for pid, name in names.items() if name == "exo-feeder"]
    assert len(feeders) == 1, names
    assert psutil.Process(feeders[0]).cmdline() == worker.cmdline()


def test_the_worker_holds_neither_the_celery_command_nor_the_runners_libraries(
    stack: Stack,
) -> None:
    mapped = {Path(m.path).name for m in psutil.Process(stack.worker.pid).memory_maps()}
    assert sorted(name for name in mapped if name.startswith(NOT_MAPPED)) == []
