"""Stale control commands: a shutdown_runner or load_runner task that waited in a jammed queue
expires (EXO_CONTROL_EXPIRES_S), and a shutdown meant for a runner that has been restarted
since leaves the new one running. Real worker, runner and API; the pool is jammed by a long job
on a host with one pool child, the module's (neither test leaves it changed: it serves on)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.api import Api, api_settings
from tests.support.processes import Processes, wait_until
from tests.support.stack import Stack, idle, new_worker, wait_tokens
from tests.support.workers import Worker, runner_state, wait_runner

LONG = {"prompt": "x", "max_tokens": 4096, "ignore_eos": True}
HOST = "ctl-host"


@pytest.fixture(scope="module")
def single(
    stack: Stack,
    module_processes: Processes,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Worker:
    data_dir = tmp_path_factory.mktemp("control")
    return new_worker(stack, module_processes, tiny_model, data_dir, HOST, worker_concurrency=1)


@pytest.fixture
def jammed(stack: Stack, single: Worker) -> tuple[Worker, str]:
    """The host, its only pool child following a long job: its control tasks wait in the queue."""
    idle(stack, single)
    job_id = stack.api.submit(**LONG, host=HOST)
    wait_tokens(stack, job_id)
    return single, job_id


def shutdown(api: Api, host: str) -> str:
    response = api.post(f"/v1/runners/tiny@{host}/shutdown", json={"mode": "hard"})
    assert response.status_code == 202, response.text
    task_id: str = response.json()["task_id"]
    return task_id


def assert_still_serving(stack: Stack, host: str, pid: int | None) -> None:
    time.sleep(2)  # long enough for a shutdown that was not dropped to have begun
    state = runner_state(stack.store, host)
    assert state.pid == pid and state.status.accepts_jobs, state


def test_a_control_task_that_waited_past_its_expiry_is_dropped_and_logged(
    stack: Stack, tiny_model: Path, jammed: tuple[Worker, str]
) -> None:
    worker, job_id = jammed
    pid = runner_state(stack.store, HOST).pid
    api = Api(api_settings(stack.redis.url, [tiny_model], control_expires_s=1))
    try:
        task_id = shutdown(api, HOST)
        time.sleep(2)  # past its expiry, still queued behind the job
        assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
        assert api.wait_job(job_id)["status"] == "cancelled"
        wait_until(
            lambda: f"Discarding revoked task: exo.shutdown_runner[{task_id}]" in worker.log_text(),
            10,
            "the expired shutdown to be dropped",
        )
        assert_still_serving(stack, HOST, pid)
    finally:
        api.close()


def test_a_shutdown_meant_for_a_runner_since_restarted_leaves_the_new_one(
    stack: Stack, jammed: tuple[Worker, str]
) -> None:
    worker, job_id = jammed
    old_pid = runner_state(stack.store, HOST).pid
    assert old_pid is not None
    shutdown(stack.api, HOST)  # names old_pid; queued behind the job
    os.kill(old_pid, signal.SIGKILL)  # the job fails, the pool child is free, the task runs
    assert stack.api.wait_job(job_id)["status"] == "failed"
    wait_until(
        lambda: "stale shutdown ignored" in worker.log_text(), 30, "the stale shutdown ignored"
    )
    new_pid = wait_runner(stack.store, HOST, "Ready", 60).pid
    assert new_pid != old_pid
    assert_still_serving(stack, HOST, new_pid)
