"""Celery tasks that control this host's runners, on the host's own queue: stop one, start one
again. Each asks the host's supervisor (through Redis) and waits, bounded, for the runner's
status."""

from __future__ import annotations

import time
from typing import Any

from celery import Task, shared_task

from exo_tasks.celery_app import LOAD_RUNNER_TASK, SHUTDOWN_RUNNER_TASK, exo_app
from exo_tasks.commands import StartRunnerRequest, StopRunner, StopRunnerRequest
from exo_tasks.errors import RunnerGone
from exo_tasks.fleet_types import RunnerState
from exo_tasks.store import Store
from exo_tasks.worker.supervision import KILL_WAIT_S, TERM_WAIT_S


@shared_task(name=SHUTDOWN_RUNNER_TASK, bind=True)
def shutdown_runner(
    self: Task[Any, Any], runner_id: str, mode: str, timeout_s: float, pid: int | None = None
) -> dict[str, Any]:
    """Ask this host's supervisor to stop a runner (the process `pid`, when given); wait
    (bounded) until it has stopped, or turns out to be another process (the request is stale)."""
    app = exo_app(self)
    command = StopRunner.model_validate({"mode": mode, "timeout_s": timeout_s})
    app.store.hosts.send_to_supervisor(
        app.settings.hostname, StopRunnerRequest(runner_id=runner_id, command=command, pid=pid)
    )
    bound = timeout_s + 1.0 + TERM_WAIT_S + KILL_WAIT_S + 5.0

    def reached(state: RunnerState) -> bool:
        return state.status.is_final or (pid is not None and state.pid != pid)

    state = _await_status(app.store, runner_id, reached, bound)
    return {"runner_id": runner_id, "status": state.status, "error": state.error}


@shared_task(name=LOAD_RUNNER_TASK, bind=True)
def load_runner(self: Task[Any, Any], runner_id: str) -> dict[str, Any]:
    """Ask this host's supervisor to start a stopped runner; wait until it takes jobs."""
    app = exo_app(self)
    app.store.hosts.send_to_supervisor(
        app.settings.hostname, StartRunnerRequest(runner_id=runner_id)
    )
    state = _await_status(
        app.store, runner_id, lambda s: s.status.accepts_jobs, app.settings.runner_start_timeout_s
    )
    return {"runner_id": runner_id, "status": state.status, "pid": state.pid}


def _await_status(store: Store, runner_id: str, reached: Any, timeout_s: float) -> RunnerState:
    deadline = time.monotonic() + timeout_s
    while True:
        state = store.runners.get(runner_id)
        if state is not None and reached(state):
            return state
        if time.monotonic() > deadline:
            raise RunnerGone(f"runner {runner_id} did not get there within {timeout_s:.0f}s")
        time.sleep(0.1)
