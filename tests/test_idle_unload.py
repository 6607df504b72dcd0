"""Idle unload: a runner idle past EXO_RUNNER_IDLE_UNLOAD_S, or past its last job's keep_alive,
frees its model's memory (its process exits) and the next job for the model loads it again."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

import psutil

from exo_tasks.fleet_types import RunnerStatus
from exo_tasks.runner.keep_alive import KeepAlive
from tests.support.processes import Processes, wait_until
from tests.support.stack import Stack
from tests.support.workers import new_worker, runner_state, wait_runner


def tree_rss(pid: int) -> int:
    """Resident memory of a process and all its descendants, in bytes."""
    root = psutil.Process(pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def last_load_s(stack: Stack, runner_id: str) -> float:
    """How long the runner's latest start took, from its status history: spawned → first Ready."""
    history = stack.api.get(f"/v1/runners/{runner_id}").json()["history"]
    changes = [(c["status"], datetime.fromisoformat(c["at"])) for c in reversed(history)]
    spawned = max(at for status, at in changes if status == "WaitingForModel")
    ready = min(at for status, at in changes if status == "Ready" and at > spawned)
    return (ready - spawned).total_seconds()


def test_an_idle_runner_frees_its_memory_and_the_next_job_loads_it_again(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    worker = new_worker(
        processes, stack.redis.url, stack.store, "idle-a", [tiny_model], tmp_path,
        runner_idle_unload_s=3,
    )  # fmt: skip
    loaded = runner_state(stack.store, "idle-a")
    assert loaded.pid is not None
    runner_rss = psutil.Process(loaded.pid).memory_info().rss
    before = tree_rss(worker.pid)

    unloaded = wait_runner(stack.store, "idle-a", RunnerStatus.UNLOADED, 3 + 5)
    assert unloaded.pid is None
    wait_until(lambda: not psutil.pid_exists(loaded.pid or 0), 5, "the runner process to exit")
    after = tree_rss(worker.pid)
    print(
        f"runner RSS {runner_rss / 2**20:.0f} MiB; host {before / 2**20:.0f} → {after / 2**20:.0f}"
    )
    assert before - after >= 0.8 * runner_rss

    # Still served: routing, readiness and the model list count an unloaded model.
    assert "tiny@idle-a" in stack.api.get("/readyz").json()["ready_runners"]
    assert "tiny" in [m["id"] for m in stack.api.get("/v1/models").json()["data"]]

    job = stack.api.wait_job(stack.api.submit(prompt="again", max_tokens=4, host="idle-a"))
    assert job["status"] == "succeeded" and job["usage"]["completion_tokens"] == 4
    again = runner_state(stack.store, "idle-a")
    assert again.status.accepts_jobs and again.pid not in (None, loaded.pid)
    # The load on demand is part of the job's wait in the queue.
    assert job["timings"]["queue_ms"] >= 1000 * last_load_s(stack, "tiny@idle-a")


def test_a_jobs_keep_alive_sets_how_long_the_idle_model_stays(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    new_worker(processes, stack.redis.url, stack.store, "idle-b", [tiny_model], tmp_path)
    kept = stack.api.wait_job(stack.api.submit(prompt="k", max_tokens=2, host="idle-b"))
    assert kept["status"] == "succeeded"
    time.sleep(2)  # no EXO_RUNNER_IDLE_UNLOAD_S: an idle runner stays loaded
    assert runner_state(stack.store, "idle-b").status == RunnerStatus.READY

    ended = time.monotonic()
    body = {"prompt": "u", "max_tokens": 2, "host": "idle-b", "keep_alive": 0}
    assert stack.api.wait_job(stack.api.submit(**body))["status"] == "succeeded"
    wait_runner(stack.store, "idle-b", RunnerStatus.UNLOADED, 5)
    assert time.monotonic() - ended < 5

    # An operator may load it ahead of the next job.
    load = stack.api.post("/v1/runners", json={"model": "tiny", "host": "idle-b"})
    assert load.status_code == 202, load.text
    wait_runner(stack.store, "idle-b", RunnerStatus.READY, 60)
    again = stack.api.wait_job(stack.api.submit(prompt="v", max_tokens=2, host="idle-b"))
    assert again["status"] == "succeeded"


def test_keep_alive_unit_rules() -> None:
    never = KeepAlive(None)
    never.idle_from(0.0)
    assert not never.due(10**9)
    never.idle_from(0.0, keep_alive_s=5)  # a job's keep_alive counts without the setting
    assert not never.due(4.9) and never.due(5.0)

    idle = KeepAlive(30)
    idle.idle_from(100.0)
    assert not idle.due(129.9) and idle.due(130.0)
    idle.idle_from(110.0, keep_alive_s=-1)  # the latest job keeps it loaded for good
    assert not idle.due(10**9)
    idle.idle_from(120.0, keep_alive_s=0)  # and the next one unloads it at once
    assert idle.due(120.0)
