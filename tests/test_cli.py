"""The `exo-tasks` command: model creation, submit, and the whole stack under `up`."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import requests

from config.settings import DEFAULT_PRESET
from tests.support.launcher import LocalStack
from tests.support.processes import EXO_TASKS, has_exited, wait_until
from tests.support.stack import Stack


def test_model_create_writes_a_loadable_model(tmp_path: Path) -> None:
    result = subprocess.run(
        [EXO_TASKS, "model", "create", "tiny", str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "m" / "config.json").is_file()
    assert (tmp_path / "m" / "model.safetensors").is_file()


def test_model_create_rejects_an_unknown_preset(tmp_path: Path) -> None:
    result = subprocess.run(
        [EXO_TASKS, "model", "create", "huge", str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "invalid choice: 'huge'" in result.stderr


def test_submit_streams_tokens_to_stdout(stack: Stack) -> None:
    env = {**os.environ, "EXO_API_URL": stack.api.url}
    result = subprocess.run(
        [EXO_TASKS, "submit", "hello", "--max-tokens", "16"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    job_id = result.stderr.split()[1]
    job = stack.api.get(f"/v1/jobs/{job_id}").json()
    assert result.stdout == job["output"]["text"] and len(result.stdout) > 0
    assert "[succeeded: length]" in result.stderr


def test_up_runs_the_whole_stack_and_ctrl_c_stops_all_of_it(local_stack: LocalStack) -> None:
    local_stack.env.update(EXO_HOSTNAME="up-host", EXO_WORKER_CONCURRENCY="2")
    launcher = local_stack.up()
    api, var = local_stack.api, local_stack.data_dir
    assert (var / "models" / DEFAULT_PRESET / "config.json").is_file()
    job_id = requests.post(
        f"{api}/v1/jobs", json={"prompt": "hi", "max_tokens": 8}, timeout=5
    ).json()["id"]
    wait_until(
        lambda: requests.get(f"{api}/v1/jobs/{job_id}", timeout=5).json()["status"] == "succeeded",
        30,
        "the job",
    )
    flower = f"http://127.0.0.1:{local_stack.env['EXO_FLOWER_PORT']}/healthcheck"
    wait_until(lambda: _answers(flower), 30, "Flower")
    assert list((var / "redis").glob("appendonly*")), "AOF persistence is on"

    everything = [launcher.pid, *(c.pid for c in psutil.Process(launcher.pid).children(True))]
    assert len(everything) >= 6  # launcher, redis, api (2), worker + pool + runner, flower
    started = time.monotonic()
    launcher.send_signal(signal.SIGINT)
    launcher.wait(timeout=20)
    wait_until(
        lambda: all(has_exited(p) for p in everything),
        10,
        "every process of the stack to exit",
    )
    assert time.monotonic() - started < 12
    # Nothing in the stack's output that reads like trouble when there is none: gevent's
    # warning about ssl at each API worker's start, Flower's inspections before any worker was
    # up.
    output = local_stack.log_text()
    assert "MonkeyPatchWarning" not in output and "Inspect method" not in output


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=1).status_code == 200
    except (requests.ConnectionError, requests.Timeout):  # not up, or still starting
        return False
