"""The `exo-tasks` commands that talk to the API (EXO_API_URL, with EXO_API_TOKEN): submit,
the jobs/runners/hosts tables, cancel and shutdown."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.conftest import Stack
from tests.support.api import Api, api_settings, serving
from tests.support.processes import EXO_TASKS, Processes, exo_env, wait_until
from tests.support.workers import start_worker, wait_runner_ready

TOKEN = "cli-token"


def exo_tasks(api: Api, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = exo_env(api_url=api.url, **({"api_token": token} if token else {}))
    return subprocess.run([EXO_TASKS, *args], env=env, capture_output=True, text=True, timeout=60)


def rows(table: str) -> list[list[str]]:
    return [line.split() for line in table.strip().splitlines()]


def test_submit_quiet_shows_a_progress_bar_then_the_text(stack: Stack) -> None:
    result = exo_tasks(stack.api, "submit", "hello", "--max-tokens", "16", "--quiet")
    assert result.returncode == 0, result.stderr
    job_id = result.stderr.split()[1]
    job = stack.api.get(f"/v1/jobs/{job_id}").json()
    assert result.stdout == job["output"]["text"] and result.stdout
    bars = [line for line in result.stderr.splitlines() if line.endswith("/16 tokens")]
    assert bars and bars[0].startswith("[#") and bars[-1].startswith("[" + "#" * 30 + "]")
    assert "[succeeded:" in result.stderr


def test_jobs_runners_and_hosts_are_tables(stack: Stack) -> None:
    job_id = stack.api.submit(prompt="listed", max_tokens=3)
    stack.api.wait_job(job_id)
    jobs = rows(exo_tasks(stack.api, "jobs", "--limit", "5").stdout)
    assert jobs[0] == ["ID", "STATUS", "MODEL", "HOST", "TOKENS", "CREATED"]
    assert [job_id, "succeeded", "tiny", "host-a", "3"] in [row[:5] for row in jobs]
    assert len(jobs) <= 6

    runners = {row[0]: row for row in rows(exo_tasks(stack.api, "runners").stdout)}
    assert runners["ID"] == ["ID", "STATUS", "PID", "ACTIVE", "RESTARTS", "ERROR"]
    assert runners["tiny@host-a"][1] in ("Ready", "Running")

    hosts = {row[0]: row for row in rows(exo_tasks(stack.api, "hosts").stdout)}
    assert hosts["HOST"] == ["HOST", "PID", "CONCURRENCY", "RUNNERS", "QUEUED"]
    assert hosts["host-a"][1] == str(stack.worker.pid)
    assert hosts["host-a"][3].startswith("tiny:")


def test_cancel_sends_the_token_and_errors_name_the_status(stack: Stack, tiny_model: Path) -> None:
    with serving(api_settings(stack.redis.url, [tiny_model], api_token=TOKEN)) as guarded:
        guarded.http.headers["Authorization"] = f"Bearer {TOKEN}"
        job_id = guarded.submit(prompt="long", max_tokens=4000, ignore_eos=True)
        refused = exo_tasks(guarded, "cancel", job_id)
        assert refused.returncode == 2 and "401 unauthorized" in refused.stderr
        result = exo_tasks(guarded, "cancel", job_id, token=TOKEN)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"job {job_id}: ")
        assert guarded.wait_job(job_id)["status"] == "cancelled"
        again = exo_tasks(guarded, "cancel", job_id, token=TOKEN)
        assert again.returncode == 2 and "409 conflict" in again.stderr


def test_shutdown_a_runner_then_its_host(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    worker = start_worker(processes, stack.redis.url, "cli-host", [tiny_model], tmp_path)
    wait_runner_ready(stack.store, worker)
    result = exo_tasks(
        stack.api, "shutdown", "runner", "tiny@cli-host", "--mode", "warm", "--timeout", "2"
    )
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert reply["runner_id"] == "tiny@cli-host" and reply["mode"] == "warm"
    assert reply["timeout_s"] == 2
    wait_until(
        lambda: stack.api.get("/v1/runners/tiny@cli-host").json()["status"] == "Shutdown",
        10,
        "the runner to stop",
    )
    result = exo_tasks(stack.api, "shutdown", "host", "cli-host", "--mode", "cold")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["mode"] == "cold"
    assert worker.process.wait(timeout=20) is not None
    missing = exo_tasks(stack.api, "shutdown", "host", "cli-host")
    assert missing.returncode == 2 and "404 not_found" in missing.stderr
