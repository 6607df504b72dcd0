"""Stopping, on the `tiny` model: the time from the request to stop until the process is gone
(for a worker: until its pool children and its runner are gone too).

exo_tasks: an idle runner stopped through the API, a worker's warm shutdown (SIGTERM) with jobs
in flight, and SIGKILL of a worker's main process with jobs in flight. mlx_lm.server, for the
same situations: SIGTERM when idle, SIGTERM with requests in flight, SIGKILL.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from functools import partial

import psutil
import requests

from bench.clients import Client, CompletionsClient, ExoClient, Trace
from bench.config import Config
from bench.contenders import START_TIMEOUT_S, Lab, start_exo, start_mlx_server
from bench.load import prompt_for
from bench.results import EXO, MLX_SERVER, Results
from exo_tasks.naming import runner_id_for
from exo_tasks.store import Store
from tests.support.processes import wait_until
from tests.support.workers import start_worker, wait_runner_ready

log = logging.getLogger("bench")
SECTION = "stopping"
IDLE = "idle stop"
WARM = "stop with jobs in flight"
KILL = "SIGKILL with jobs in flight"
IN_FLIGHT_TOKENS = 1000
GONE_TIMEOUT_S = 60.0
# After the stop: in-flight requests that have not ended by then never will.
FINISH_WAIT_S = 5.0


def _tree(pid: int) -> list[psutil.Process]:
    parent = psutil.Process(pid)
    return [parent, *parent.children(recursive=True)]


def _time_until_gone(procs: list[psutil.Process], stop: Callable[[], object]) -> float:
    """Milliseconds from calling `stop` until every process in `procs` has exited."""
    started = time.monotonic()
    stop()
    _, alive = psutil.wait_procs(procs, timeout=GONE_TIMEOUT_S)
    if alive:
        raise RuntimeError(f"{alive} still running {GONE_TIMEOUT_S}s after the stop")
    return (time.monotonic() - started) * 1000


class InFlight:
    """Requests started in threads; `wait_streaming()` returns once each has a token."""

    def __init__(self, make_client: Callable[[], Client], count: int) -> None:
        self.make_client = make_client
        self.traces = [Trace(time.monotonic()) for _ in range(count)]
        self.threads = [
            threading.Thread(target=self._send, args=(i,), daemon=True) for i in range(count)
        ]
        for thread in self.threads:
            thread.start()

    def _send(self, index: int) -> None:
        self.make_client().run(self.traces[index], prompt_for(index, 0, "stop"), IN_FLIGHT_TOKENS)

    def wait_streaming(self) -> None:
        wait_until(lambda: all(t.token_times for t in self.traces), 60, "in-flight tokens")

    def running(self) -> list[Trace]:
        return [t for t in self.traces if t.ended is None and not t.error]

    def finished(self, at_stop: list[Trace]) -> str:
        """What became of the requests that were running when the stop was requested."""
        deadline = time.monotonic() + FINISH_WAIT_S
        for thread in self.threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0))
        done = sum(1 for t in at_stop if t.latency_s is not None)
        return f"{len(at_stop)} in flight at the stop, {done} of them finished"


def run(lab: Lab, config: Config, results: Results) -> None:
    log.info("stopping: %s", EXO)
    _exo_idle(lab, config, results)
    notes: dict[tuple[str, str], str] = {}
    for _ in range(config.repeats):
        notes.update(_exo_in_flight(lab, config, results))
    log.info("stopping: %s", MLX_SERVER)
    for _ in range(config.repeats):
        notes.update(_mlx(lab, config, results))
    for (name, contender), note in notes.items():
        row = results.find(SECTION, name, contender)
        if row is not None:
            row.note = note


def _restarted(store: Store, runner_id: str, old_pid: int) -> bool:
    state = store.runners.get(runner_id)
    return state is not None and state.pid != old_pid and state.status.accepts_jobs


def _exo_idle(lab: Lab, config: Config, results: Results) -> None:
    """Shut the idle runner down through the API (warm), then load it again, `repeats` times."""
    stack = start_exo(lab, "exo-stop-idle", config.tiny_model)
    try:
        worker = stack.workers[0]
        runner_id = runner_id_for(stack.model, worker.host)
        for _ in range(config.repeats):
            state = wait_runner_ready(stack.store, worker, stack.model)
            assert state.pid is not None
            shutdown = partial(
                requests.post,
                f"{stack.url}/v1/runners/{runner_id}/shutdown",
                json={"mode": "warm"},
                timeout=10,
            )
            elapsed = _time_until_gone([psutil.Process(state.pid)], shutdown)
            results.sample(SECTION, IDLE, EXO, "ms", elapsed)
            load = {"model": stack.model, "host": worker.host}
            requests.post(f"{stack.url}/v1/runners", json=load, timeout=10)
            wait_until(
                partial(_restarted, stack.store, runner_id, state.pid),
                START_TIMEOUT_S,
                "the runner to load again",
            )
    finally:
        lab.stop(stack.processes)


def _exo_in_flight(lab: Lab, config: Config, results: Results) -> dict[tuple[str, str], str]:
    """A warm shutdown (SIGTERM) of a worker with jobs in flight, then SIGKILL of a second
    worker of the same stack with jobs in flight."""
    stack = start_exo(lab, "exo-stop", config.tiny_model)
    notes = {}
    try:
        for name, sig in ((WARM, signal.SIGTERM), (KILL, signal.SIGKILL)):
            if name == KILL:
                worker = start_worker(
                    stack.processes, stack.redis.url, "bench-kill", [config.tiny_model],
                    stack.directory, worker_concurrency=8,
                )  # fmt: skip
                wait_runner_ready(stack.store, worker, stack.model, START_TIMEOUT_S)
            else:
                worker = stack.workers[0]
            jobs = InFlight(
                partial(ExoClient, stack.url, ignore_eos=True), config.stop_jobs_in_flight
            )
            jobs.wait_streaming()
            pid, at_stop = worker.pid, jobs.running()
            elapsed = _time_until_gone(_tree(pid), partial(os.kill, pid, sig))
            results.sample(SECTION, name, EXO, "ms", elapsed)
            notes[(name, EXO)] = jobs.finished(at_stop)
    finally:
        lab.stop(stack.processes)
    return notes


def _mlx(lab: Lab, config: Config, results: Results) -> dict[tuple[str, str], str]:
    notes = {}
    for name, sig, in_flight in (
        (IDLE, signal.SIGTERM, 0),
        (WARM, signal.SIGTERM, config.stop_jobs_in_flight),
        (KILL, signal.SIGKILL, config.stop_jobs_in_flight),
    ):
        server = start_mlx_server(lab, "mlx-stop", config.tiny_model)
        try:
            jobs = InFlight(partial(CompletionsClient, server.url), in_flight)
            jobs.wait_streaming()
            pid, at_stop = server.processes.started[0].pid, jobs.running()
            elapsed = _time_until_gone(_tree(pid), partial(os.kill, pid, sig))
            results.sample(SECTION, name, MLX_SERVER, "ms", elapsed)
            if in_flight:
                notes[(name, MLX_SERVER)] = jobs.finished(at_stop)
        finally:
            lab.stop(server.processes)
    return notes
