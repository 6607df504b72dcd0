"""The `exo-tasks` commands that talk to the API (EXO_API_URL, with EXO_API_TOKEN): submit,
the jobs/runners/hosts tables, cancel and shutdown."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from exo_tasks.types import JobRequest
from tests.support.api import Api, api_settings, serving
from tests.support.cli import UTC_TIME, exo_tasks, rows, run_cli
from tests.support.held_hosts import held_hosts
from tests.support.processes import (
    Processes,
    exo_env,
    free_port,
    start_redis,
    wait_until,
)
from tests.support.stack import LONG, Stack, wait_tokens
from tests.support.workers import start_worker, wait_runner_ready

TOKEN = "cli-token"


def test_submit_quiet_shows_a_progress_bar_then_the_text(stack: Stack) -> None:
    result = exo_tasks(stack.api, "submit", "hello", "--max-tokens", "16", "--quiet")
    assert result.returncode == 0, result.stderr
    job_id = result.stderr.split()[1]
    job = stack.api.get(f"/v1/jobs/{job_id}").json()
    assert result.stdout == job["output"]["text"] and result.stdout
    bars = [line for line in result.stderr.splitlines() if line.endswith("/16 tokens")]
    assert bars and bars[0].startswith("[#") and bars[-1].startswith("[" + "#" * 30 + "]")
    assert "[succeeded:" in result.stderr


def test_submit_quiets_bar_counts_tokens_not_text_events(stack: Stack) -> None:
    # A token that may begin a stop string is held back, the one that completes it cut: they
    # send no text. Stop at the last token of a free run of the same (greedy) job.
    free = stack.api.wait_job(
        stack.api.submit(prompt="count", max_tokens=16, ignore_eos=True, logprobs=True)
    )
    text, last = free["output"]["text"], free["output"]["logprobs"][-1]["token"]
    assert text.endswith(last) and text.find(last) == len(text) - len(last)
    result = exo_tasks(
        stack.api,
        *("submit", "count", "--max-tokens", "16", "--ignore-eos", "--stop", last, "--quiet"),
    )
    assert result.returncode == 0, result.stderr
    job_id = result.stderr.split()[1]
    job = stack.api.get(f"/v1/jobs/{job_id}").json()
    assert job["output"]["finish_reason"] == "stop" and job["usage"]["completion_tokens"] == 16
    assert stack.store.streams.streamed_text(job_id)[1] < 16  # fewer text events than tokens
    bars = [line for line in result.stderr.splitlines() if line.endswith("/16 tokens")]
    assert bars[-1] == "[" + "#" * 30 + "] 16/16 tokens"


def test_jobs_runners_and_hosts_are_tables(stack: Stack) -> None:
    job_id = stack.api.submit(prompt="listed", max_tokens=3)
    stack.api.wait_job(job_id)
    jobs = rows(exo_tasks(stack.api, "jobs", "--limit", "5").stdout)
    assert jobs[0] == ["ID", "STATUS", "MODEL", "HOST", "TOKENS", "FINISH", "CREATED", "ERROR"]
    listed = {row[0]: row for row in jobs}
    assert listed[job_id][:6] == [job_id, "succeeded", "tiny", "host-a", "3/3", "length"]
    assert UTC_TIME.fullmatch(listed[job_id][6]) and listed[job_id][7] == "-"
    assert len(jobs) <= 6

    runners = {row[0]: row for row in rows(exo_tasks(stack.api, "runners").stdout)}
    assert runners["ID"] == ["ID", "STATUS", "PID", "ACTIVE", "RESTARTS", "ERROR"]
    assert runners["tiny@host-a"][1] in ("Ready", "Running")

    hosts = {row[0]: row for row in rows(exo_tasks(stack.api, "hosts").stdout)}
    assert hosts["HOST"] == ["HOST", "PID", "CONCURRENCY", "RUNNERS", "QUEUED"]
    assert hosts["host-a"][1] == str(stack.worker.pid)
    assert hosts["host-a"][3].startswith("tiny:")


def test_jobs_shows_a_running_jobs_tokens_against_its_maximum_and_why_jobs_ended(
    stack: Stack,
) -> None:
    running = stack.api.submit(**LONG)
    # Under EXO_MAX_PROMPT_TOKENS (8192) at the API's door, over it after the chat template,
    # which only the runner applies: the job fails there, with an error to show.
    failed = stack.api.submit(messages=[{"role": "user", "content": "a" * 8_190}], max_tokens=4)
    try:
        wait_tokens(stack, running)
        row = {r[0]: r for r in rows(exo_tasks(stack.api, "jobs", "--status", "running").stdout)}
        done, maximum = row[running][4].split("/")
        assert 0 < int(done) < 4000 and maximum == "4000" and row[running][5] == "-"
    finally:
        stack.api.post(f"/v1/jobs/{running}/cancel")
    error = stack.api.wait_job(failed)["error"]
    table = exo_tasks(stack.api, "jobs", "--status", "failed").stdout
    line = next(line for line in table.splitlines() if line.startswith(failed))
    assert " ".join(error.split())[:40] in line
    assert stack.api.wait_job(running)["status"] == "cancelled"
    cancelled = {r[0]: r for r in rows(exo_tasks(stack.api, "jobs", "--limit", "10").stdout)}
    assert cancelled[running][1] == "cancelled" and cancelled[running][5] == "cancelled"


def test_empty_listings_say_so(processes: Processes, tiny_model: Path, tmp_path: Path) -> None:
    # A Redis of its own: no job, no host, no batch has ever been there.
    redis = start_redis(processes, tmp_path)
    with serving(api_settings(redis.url, [tiny_model])) as api:
        for args, line in [
            (["jobs", "--status", "failed"], "no jobs with status failed"),
            (["jobs"], "no jobs"),
            (["hosts"], "no hosts"),
            (["runners"], "no runners"),
            (["batch", "list"], "no batches"),
        ]:
            result = exo_tasks(api, *args)
            assert result.returncode == 0 and result.stdout == line + "\n", (args, result)


def test_an_unreachable_api_is_one_line_naming_its_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for args in (["jobs"], ["submit", "hi"], ["batch", "list"]):
        result = run_cli(exo_env(api_url=url), *args)
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr == f"exo-tasks: cannot reach the API at {url}\n"


def test_submit_help_states_the_apis_cap_from_the_settings() -> None:
    env = exo_env(max_tokens=64)
    help_text = " ".join(run_cli(env, "submit", "--help").stdout.split())
    assert "tokens to generate, 1 to 64 (EXO_MAX_TOKENS, the API's cap)" in help_text
    refused = run_cli(env, "submit", "p", "--max-tokens", "65")
    assert refused.returncode == 2
    assert "--max-tokens: 65 is out of range: must be >= 1 and <= 64" in refused.stderr


def test_cancel_sends_the_token_and_errors_name_the_status(stack: Stack, tiny_model: Path) -> None:
    with serving(api_settings(stack.redis.url, [tiny_model], api_token=TOKEN)) as guarded:
        guarded.http.headers["Authorization"] = f"Bearer {TOKEN}"
        job_id = guarded.submit(prompt="long", max_tokens=4000, ignore_eos=True)
        refused = exo_tasks(guarded, "cancel", job_id)
        assert refused.returncode == 2 and "401 unauthorized" in refused.stderr
        result = exo_tasks(guarded, "cancel", job_id, token=TOKEN)
        assert result.returncode == 0, result.stderr
        # It waits for the job's final status: a running job ends at its runner's next step.
        assert result.stdout == f"job {job_id}: cancelled\n"
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


def test_submit_takes_the_sampling_options_with_the_api_defaults(stack: Stack) -> None:
    help_text = exo_tasks(stack.api, "submit", "--help").stdout
    for option in ("--temperature", "--top-p", "--seed", "--stop", "--priority", "--ignore-eos"):
        assert option in help_text
    assert "--system" in help_text and "--timeout" in help_text
    # The default is the API's own (JobRequest's), not a copy of it.
    assert JobRequest.model_fields["max_tokens"].default == 256
    assert "(default: 256)" in " ".join(help_text.split())

    plain = exo_tasks(stack.api, "submit", "hi", "--quiet")
    assert plain.returncode == 0, plain.stderr
    request = job_request(stack, plain)
    assert request["max_tokens"] == 256 and request["prompt"] == "hi"
    assert request["temperature"] == 0 and request["priority"] == "normal"

    result = exo_tasks(
        stack.api,
        *("submit", "hi", "--max-tokens", "6", "--temperature", "0.7", "--top-p", "0.9"),
        *("--seed", "7", "--stop", "zz", "--stop", "yy", "--priority", "high", "--ignore-eos"),
        *("--system", "be brief", "--timeout", "30"),
    )
    assert result.returncode == 0, result.stderr
    request = job_request(stack, result)
    messages = [(m["role"], m["content"]) for m in request["messages"]]
    assert messages == [("system", "be brief"), ("user", "hi")]
    assert (request["temperature"], request["top_p"], request["seed"]) == (0.7, 0.9, 7)
    assert request["stop"] == ["zz", "yy"] and request["priority"] == "high"
    assert request["ignore_eos"] is True and request["timeout_s"] == 30


def job_request(stack: Stack, result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    job_id = result.stderr.split()[1]
    request: dict[str, Any] = stack.api.get(f"/v1/jobs/{job_id}").json()["request"]
    return request


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["jobs", "--limit", "0"], "argument --limit: 0 is out of range: must be >= 1 and <= 1000"),
        (["jobs", "--limit", "x"], "argument --limit: 'x' is not an integer >= 1 and <= 1000"),
        (
            ["jobs", "--status", "done"],
            "invalid choice: 'done' (choose from 'queued', 'running', 'succeeded', 'failed', "
            "'cancelled', 'timed_out')",
        ),
        (["submit", "p", "--max-tokens", "0"], "--max-tokens: 0 is out of range: must be >= 1"),
        (["submit", "p", "--max-tokens", "5000"], "5000 is out of range: must be >= 1 and <= 4096"),
        (["submit", "p", "--temperature", "2.5"], "must be >= 0.0 and <= 2.0"),
        (["submit", "p", "--top-p", "0"], "--top-p: 0 is out of range: must be > 0.0 and <= 1.0"),
        (["submit", "p", "--seed", str(2**64)], "must be >= 0 and < 18446744073709551616"),
        (["submit", "p", "--timeout", "inf"], "--timeout: inf is out of range: must be > 0"),
        (["submit", "p", "--priority", "urgent"], "(choose from 'high', 'normal', 'low')"),
        (["submit", "p", *["--stop", "s"] * 5], "argument --stop: at most 4 stop strings"),
        (["submit", "p", "--stop", ""], "argument --stop: a stop string cannot be empty"),
        (["cancel", "j", "--wait", "-1"], "argument --wait: -1 is out of range: must be >= 0"),
    ],
)
def test_arguments_are_checked_naming_the_valid_values(
    stack: Stack, args: list[str], message: str
) -> None:
    result = exo_tasks(stack.api, *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_instances_place_list_show_and_shutdown(stack: Stack, tiny_model: Path) -> None:
    # Held hosts: live to the API, no worker moving the instance (tests/support/held_hosts.py).
    with held_hosts(stack.store, "cli-a", "cli-b"):
        placed = exo_tasks(stack.api, "instances", "place", str(tiny_model), "cli-a", "cli-b")
        assert placed.returncode == 0, placed.stderr
        instance_id = placed.stdout.split()[1].rstrip(":")
        try:
            check_instance_commands(stack.api, instance_id, tiny_model)
        finally:
            stack.store.instances.remove(instance_id)


def check_instance_commands(api: Api, instance_id: str, model: Path) -> None:
    listed = rows(exo_tasks(api, "instances", "list").stdout)
    assert listed[0] == ["ID", "STATUS", "MODEL", "PARALLEL", "HOSTS", "ERROR"]
    assert [instance_id, "Pending", "tiny", "tensor", "cli-a,cli-b", "-"] in listed
    shown = exo_tasks(api, "instances", "show", instance_id).stdout.splitlines()
    assert shown[:2] == [
        f"instance {instance_id}: Pending",
        f"model tiny ({model}), tensor parallel",
    ]
    assert rows("\n".join(shown[2:])) == [
        ["RANK", "HOST", "PID", "STATUS", "WEIGHTS_BYTES", "ERROR"],
        ["0", "cli-a", "-", "WaitingForModel", "-", "-"],
        ["1", "cli-b", "-", "WaitingForModel", "-", "-"],
    ]
    stopped = exo_tasks(api, "instances", "shutdown", instance_id, "--mode", "hard")
    assert stopped.stdout == f"instance {instance_id}: Shutdown (hard)\n"
    # The API's refusals, with their status: the command exits 2.
    again = exo_tasks(api, "instances", "shutdown", instance_id)
    assert again.returncode == 2
    assert again.stderr == f"exo-tasks: 409 conflict: instance '{instance_id}' is Shutdown\n"
    dead = exo_tasks(api, "instances", "place", str(model), "cli-a", "ghost")
    assert dead.returncode == 2 and "404 not_found: no live worker on host 'ghost'" in dead.stderr
    bad = exo_tasks(api, "instances", "place", str(model), "cli-a", "--parallel", "data")
    assert bad.returncode == 2 and "invalid choice: 'data'" in bad.stderr
