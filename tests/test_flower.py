"""Flower, as `exo-tasks flower` runs it: basic auth, both hosts' workers, and inference tasks as
Flower shows and controls them, through Flower's own HTTP API: `STARTED` with their progress
while their job runs, a revoke (plain, or terminate with any signal) that cancels the job, and
a final state that follows the job's ending."""

from __future__ import annotations

import ast
import functools
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
from celery import states
from celery.result import AsyncResult

from exo_tasks.naming import host_queue
from tests.support.flower import AUTH, Flower
from tests.support.processes import Processes, wait_until
from tests.support.stack import LONG, Stack, TwoHosts, new_worker, wait_tokens
from tests.support.workers import runner_state

BY_API = "cancelled through the API"
BY_REVOKE = "revoked in Flower (or by celery control revoke)"
BETA = {"model": "beta"}  # served by fleet-y only
BETA_RUNNER = "beta@fleet-y"


def ended_as(task: dict[str, Any]) -> dict[str, Any]:
    """A REVOKED task's result in Flower: its job's final tokens and who cancelled it."""
    ended: dict[str, Any] = ast.literal_eval(task["result"])
    return ended


def revoked_task(flower: Flower, job: dict[str, Any], reason: str) -> dict[str, Any]:
    """A long job on `beta`, cancelled: its task once REVOKED in Flower, whose result names the
    job's final tokens (not its last progress report's), its runner and `reason`."""
    task = flower.wait_state(job["id"], "REVOKED")
    assert ended_as(task) == {
        "tokens": job["usage"]["completion_tokens"],
        "max_tokens": 4000,
        "runner": BETA_RUNNER,
        "reason": reason,
    }
    return task


def result_of(stack: Stack, task_id: str) -> AsyncResult[Any]:
    return AsyncResult(task_id, app=stack.api.app.extensions["exo"].celery)


def test_flower_shows_workers_and_a_running_task_started_behind_basic_auth(
    stack: Stack, flower: Flower
) -> None:
    assert flower.get("/api/workers").status_code == 401
    # The password is given by environment: a command line is visible to every local user.
    assert AUTH[1] not in " ".join(psutil.Process(flower.process.pid).cmdline())
    assert flower.get("/api/tasks", auth=("admin", "wrong")).status_code == 401
    workers = flower.get("/api/workers?refresh=1", auth=AUTH).json()
    assert {"exo@fleet-x", "exo@fleet-y"} <= set(workers)
    assert workers["exo@fleet-x"]["stats"]["pool"]["max-concurrency"] == 1

    long_id = stack.api.submit(**LONG, **BETA)
    try:
        # Progress is reported at most every 2 s: the first report with tokens in it.
        info = wait_until(
            lambda: (i := flower.task(long_id)).get("state") == "STARTED" and i.get("result") and i,
            15,
            "Flower to show the task STARTED with its progress",
            interval_s=0.2,
        )
        progress = ast.literal_eval(info["result"])
        assert progress["max_tokens"] == 4000 and 0 < progress["tokens"] < 4000
        # The runner that runs it (Flower names only the worker).
        assert progress["runner"] == BETA_RUNNER
        assert info["worker"] == "exo@fleet-y" and info["name"] == "exo.inference"
        # Flower's "Started" filter finds it, and its Terminate button is drawn.
        assert long_id in flower.tasks(state="STARTED")
        page = flower.get(f"/task/{long_id}", auth=AUTH).text
        assert 'id="task-terminate"' in page
        result = result_of(stack, long_id)
        assert str(result.state) == "STARTED" and result.info["max_tokens"] == 4000
    finally:
        assert stack.api.post(f"/v1/jobs/{long_id}/cancel").status_code == 202
    # A job cancelled through the API: its task is REVOKED, in Flower and in the backend, with
    # its final tokens (not its last progress report's) and who cancelled it.
    job = stack.api.wait_job(long_id)
    assert job["status"] == "cancelled"
    revoked_task(flower, job, BY_API)
    tokens = job["usage"]["completion_tokens"]
    result = result_of(stack, long_id)
    assert str(result.state) == "REVOKED" and str(result.info) == f"{BY_API} ({tokens} tokens)"

    short_id = stack.api.submit(prompt="short", max_tokens=8, **BETA)
    assert stack.api.wait_job(short_id)["status"] == "succeeded"
    task = flower.wait_state(short_id, "SUCCESS")
    assert task["name"] == "exo.inference" and task["worker"] == "exo@fleet-y"
    assert "'status': 'succeeded'" in task["result"]
    assert f"'runner': '{BETA_RUNNER}'" in task["result"]
    # Its client, as Flower names it, says what sent it.
    assert re.fullmatch(r"exo-api@\S+ \(pid \d+\)", task["client"]), task["client"]


def test_flowers_api_asks_for_basic_auth_in_the_realm_of_its_pages(flower: Flower) -> None:
    # A browser that opened a deep link (/task/<id>) re-sends its credentials to the API (the
    # Terminate button's POST) only when the API's 401 asks for the realm of the pages.
    challenge = flower.get("/").headers["WWW-Authenticate"]
    assert challenge == 'Basic realm="flower"'
    revoke = f"{flower.url}/api/task/revoke/{'0' * 32}"
    for response in (
        flower.get("/api/workers"),
        flower.get("/api/tasks", auth=("admin", "wrong")),
        requests.post(revoke, params={"terminate": "true"}, timeout=10),
    ):
        assert response.status_code == 401
        assert response.headers.get("WWW-Authenticate") == challenge
    assert flower.get("/api/workers", auth=AUTH).status_code == 200


def worker_processes(fleet: TwoHosts) -> set[int]:
    """The pids of fleet-y's pool children and runners: a killed pool child is replaced."""
    return {child.pid for child in psutil.Process(fleet.y.pid).children(recursive=True)}


@pytest.mark.parametrize(
    "how",
    [{}, {"terminate": "true"}, {"terminate": "true", "signal": "SIGKILL"}],
    ids=["revoke", "terminate", "terminate-SIGKILL"],
)
def test_a_revoke_from_flower_cancels_the_job_and_spares_its_pool_child_and_model(
    stack: Stack, fleet: TwoHosts, flower: Flower, how: dict[str, str]
) -> None:
    children = worker_processes(fleet)
    runner = runner_state(stack.store, "fleet-y", "beta")
    job_id = stack.api.submit(**LONG, **BETA)
    wait_tokens(stack, job_id)
    flower.wait_state(job_id, "STARTED")

    revoked = time.monotonic()
    flower.revoke(job_id, **how)
    job = stack.api.wait_job(job_id, timeout_s=3)
    assert time.monotonic() - revoked < 3
    # The same ending as POST /v1/jobs/<id>/cancel: the partial text kept.
    assert job["status"] == "cancelled" and job["output"]["finish_reason"] == "cancelled"
    assert 0 < job["usage"]["completion_tokens"] < 4000 and job["output"]["text"]
    assert revoked_task(flower, job, BY_REVOKE)["worker"] == "exo@fleet-y"
    assert str(result_of(stack, job_id).state) == "REVOKED"

    # No process was signalled: the same pool children, the same runner with its one load.
    assert worker_processes(fleet) == children
    after = runner_state(stack.store, "fleet-y", "beta")
    assert after.pid == runner.pid and after.model_loads == runner.model_loads
    assert "Terminating" not in fleet.y.log_text()
    # The pool runs the next job.
    next_id = stack.api.submit(prompt="next", max_tokens=4, **BETA)
    assert stack.api.wait_job(next_id)["status"] == "succeeded"


def test_a_task_whose_streaming_client_went_away_shows_why_it_ended(
    stack: Stack, flower: Flower
) -> None:
    body = {"prompt": "go on", "max_tokens": 4000, "ignore_eos": True, "stream": True, **BETA}
    response = stack.api.post("/v1/completions", json=body, stream=True)
    job_id = response.headers["X-Exo-Job-Id"]
    wait_tokens(stack, job_id)
    response.close()
    job = stack.api.wait_job(job_id, timeout_s=5)
    assert job["status"] == "cancelled"
    revoked_task(flower, job, "cancelled: its streaming client went away or fell behind")


def test_failed_and_timed_out_jobs_are_failures_with_their_reason(
    stack: Stack, flower: Flower
) -> None:
    timed_id = stack.api.submit(**LONG, **BETA, timeout_s=1)
    # One token per character with the tiny model: over EXO_MAX_PROMPT_TOKENS (8192), which
    # only the runner counts.
    failed_id = stack.api.submit(prompt="a" * 9000, max_tokens=4, **BETA)
    timed_job = stack.api.wait_job(timed_id)
    assert timed_job["status"] == "timed_out" and timed_job["runner_id"] == BETA_RUNNER
    failed = stack.api.wait_job(failed_id)
    assert failed["status"] == "failed" and failed["error"]

    timed = flower.wait_state(timed_id, "FAILURE")
    assert "JobEnded" in timed["exception"]
    limit = f"timed_out on runner {BETA_RUNNER}: its soft time limit of 1s was reached"
    assert limit in timed["exception"]
    # This task's own few frames, not the Redis read the limit cut (a chain of 60 lines that
    # read like a Redis crash).
    assert "During handling" not in timed["traceback"] and "redis" not in timed["traceback"]
    assert timed["traceback"].count('  File "') <= 4, timed["traceback"]  # Celery's 2, ours 2
    task = flower.wait_state(failed_id, "FAILURE")
    assert "job failed" in task["exception"] and failed["error"][:40] in task["exception"]
    result = result_of(stack, failed_id)
    assert str(result.state) == "FAILURE" and "job failed" in str(result.info)

    # No task is in a custom state (such as PROGRESS), nor STARTED once its job has ended.
    tasks = flower.tasks()
    assert {task["state"] for task in tasks.values()} <= states.ALL_STATES
    for task_id, task in tasks.items():
        if task["name"] == "exo.inference" and task["state"] == "STARTED":
            stack.api.wait_job(task_id)
            wait_until(
                functools.partial(flower.left_state, task_id, "STARTED"),
                5,
                f"task {task_id} to leave STARTED once its job ended",
            )


def waiting(stack: Stack, flower: Flower, host: str = "fleet-x") -> tuple[int, int]:
    """The messages waiting in `host`'s own queue, as GET /v1/hosts (`exo-tasks hosts`) and
    Flower's Broker page (its API) count them."""
    queue = host_queue(host)
    hosts = stack.api.get("/v1/hosts").json()
    ours = next(h for h in hosts if h["name"] == host)["queues"][queue]
    lengths = flower.get("/api/queues/length", auth=AUTH).json()["active_queues"]
    flowers = next(q["messages"] for q in lengths if q["name"] == queue)
    return ours, flowers


def not_ended_before(stack: Stack, job_id: str, moment: float) -> bool:
    """Whether the job was still queued or running at `moment` (a Unix time): it is now, or it
    ended after. A loaded machine may end a long job during a test's next steps; when it ended
    still says what it held until then."""
    job = stack.api.get(f"/v1/jobs/{job_id}").json()
    if job["status"] in ("queued", "running"):
        return True
    return datetime.fromisoformat(job["finished_at"]).timestamp() > moment


def test_a_job_cancelled_while_queued_is_revoked_at_once_and_waits_in_no_queue(
    stack: Stack, flower: Flower
) -> None:
    # fleet-x has one pool child: jobs pinned there wait in its queue behind the busy one, and
    # behind `next_up`, which the child takes first (the queue is first in, first out).
    busy = stack.api.submit(**LONG, host="fleet-x", model="alpha")
    wait_tokens(stack, busy)
    next_up = stack.api.submit(**LONG, host="fleet-x", model="alpha")
    pinned = {"prompt": "never", "max_tokens": 8, "host": "fleet-x", "model": "alpha"}
    try:
        by_flower, by_api = stack.api.submit(**pinned), stack.api.submit(**pinned)
        assert waiting(stack, flower) == (3, 3)

        flower.revoke(by_flower)
        assert stack.api.post(f"/v1/jobs/{by_api}/cancel").status_code == 202
        for job_id, reason in ((by_flower, BY_REVOKE), (by_api, BY_API)):
            # Before, PENDING until a worker took the message: 30 s and 80 s in two runs.
            task = flower.wait_state(job_id, "REVOKED", timeout_s=3)
            ended = {"tokens": 0, "max_tokens": 8, "runner": None, "reason": reason}
            assert ended_as(task) == ended
            assert task["worker"].startswith("exo@")  # the worker that withdrew its message
            assert str(result_of(stack, job_id).state) == "REVOKED"
            job = stack.api.get(f"/v1/jobs/{job_id}").json()
            assert job["status"] == "cancelled" and job["started_at"] is None
            assert job["runner_id"] is None and job["output"]["text"] == ""
        # Their messages are gone from the queue, counted as waiting by no one (next_up's alone
        # may be), and no worker took them: the pool child had not yet ended next_up (two long
        # jobs, 16 s quiet) when the queue was read.
        read_at = time.time()
        assert max(waiting(stack, flower)) <= 1
        assert not_ended_before(stack, next_up, read_at)
    finally:
        for job_id in (next_up, busy):
            flower.revoke(job_id, terminate="true")
    for job_id in (busy, next_up):
        # Revoked, or on a loaded machine ended first: either way its task follows.
        ended = stack.api.wait_job(job_id, timeout_s=3)["status"]
        flower.wait_state(job_id, {"cancelled": "REVOKED", "succeeded": "SUCCESS"}[ended])


def test_flower_shows_each_hosts_runners_and_instances_on_its_worker_page(
    stack: Stack, fleet: TwoHosts, flower: Flower
) -> None:
    alpha = fleet.x.env["EXO_MODELS"]
    response = stack.api.post(
        "/v1/instances", json={"model": alpha, "hosts": ["fleet-x", "fleet-y"]}
    )
    assert response.status_code == 202, response.text
    instance_id = response.json()["id"]
    try:
        # A refresh joins an inspection already under way: the next one has the instance.
        workers = wait_until(
            lambda: (
                (w := flower.get("/api/workers?refresh=1", auth=AUTH).json())
                and instance_id in w["exo@fleet-y"]["stats"].get("exo_instances", "")
                and instance_id in w["exo@fleet-x"]["stats"].get("exo_instances", "")
                and w
            ),
            10,
            "Flower's worker stats to show the instance",
            interval_s=0.5,
        )
        x, y = workers["exo@fleet-x"]["stats"], workers["exo@fleet-y"]["stats"]
        # As far as the hosts' supervisors have moved it; each host names its own rank.
        for stats, rank in ((x, 0), (y, 1)):
            status = "(Pending|Starting|Ready)"
            line = rf"{instance_id}: {status}, rank {rank} of 2 \(alpha, tensor parallel\)"
            assert re.fullmatch(line, stats["exo_instances"]), stats["exo_instances"]
        # Its whole runners first (a rank's runner, by its instance's id, after them).
        assert x["exo_runners"].startswith("alpha@fleet-x: Ready")
        assert y["exo_runners"].startswith("alpha@fleet-y: Ready; beta@fleet-y: Ready")
        # The worker's page, its Other tab.
        page = flower.get("/worker/exo@fleet-x", auth=AUTH).text
        assert "exo_instances" in page and instance_id in page
    finally:
        stack.store.instances.remove(instance_id)


def test_flowers_shut_down_is_our_warm_shutdown(
    stack: Stack, flower: Flower, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    host, node, drain_s = "fl-down", "exo@fl-down", 2
    inspect = {"workername": node, "refresh": "1"}  # 404 until Flower has inspected it
    worker = new_worker(
        stack,
        processes,
        tiny_model,
        tmp_path,
        host,
        worker_concurrency=2,
        worker_soft_shutdown_s=drain_s,
    )
    wait_until(
        lambda: flower.get("/api/workers", params=inspect, auth=AUTH).status_code == 200,
        10,
        "Flower to know the new worker",
        interval_s=0.5,
    )
    long_id = stack.api.submit(**LONG, host=host)
    wait_tokens(stack, long_id)
    # In flight too, and short enough to end within the drain window on a loaded machine.
    short_id = stack.api.submit(prompt="short", max_tokens=40, ignore_eos=True, host=host)
    wait_tokens(stack, short_id)

    started = time.monotonic()
    response = requests.post(f"{flower.url}/api/worker/shutdown/{node}", auth=AUTH, timeout=10)
    assert response.status_code == 200, response.text
    # Out of /v1/hosts (and so of routing and /readyz) as the stop begins, while its jobs
    # drain: within the drain window, the long job still running (quiet, 0.01-0.2 s; over 1 s
    # once on a loaded CI machine). Celery's own shutdown kept it listed to the end.
    wait_until(
        lambda: host not in {h["name"] for h in stack.api.get("/v1/hosts").json()},
        drain_s,
        "the host to leave /v1/hosts",
        interval_s=0.1,
    )
    print(f"host left /v1/hosts {time.monotonic() - started:.2f}s after the POST began")
    assert stack.api.get(f"/v1/jobs/{long_id}").json()["status"] == "running"
    worker.process.wait(timeout=15)
    # The drain window, then the runner's quick stop: not the long job's end (Celery's own
    # shutdown waited for every running job, up to its time limit).
    assert time.monotonic() - started < drain_s + 5
    assert stack.api.get(f"/v1/jobs/{short_id}").json()["status"] == "succeeded"
    long = stack.api.get(f"/v1/jobs/{long_id}").json()
    assert long["status"] == "queued" and long["attempts"] == 1  # requeued, not lost
    assert stack.api.post(f"/v1/jobs/{long_id}/cancel").status_code == 202
