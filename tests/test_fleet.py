"""Several hosts on one Redis: routing by model and by host, liveness, queue depths, priorities
and the queue cap. Hosts are real `exo-tasks worker` processes with their own EXO_HOSTNAME."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from exo_tasks import jobs
from exo_tasks.modelgen import create_model
from exo_tasks.naming import host_queue, runner_id_for
from exo_tasks.prefix_routing import last_host, prompt_digests
from exo_tasks.recovery import HEARTBEAT_TTL_S
from exo_tasks.store import job_key
from exo_tasks.types import JobRecord, JobRequest
from tests.support.api import Api, api_settings, serving
from tests.support.metrics import Samples, scrape, value
from tests.support.processes import Processes, wait_until
from tests.support.stack import Stack, TwoHosts
from tests.support.workers import (
    Worker,
    new_worker,
    pool_children,
    runner_state,
    start_worker,
    wait_runner_ready,
)

# A job of alpha on fleet-x that is still running seconds on (4,000 tokens: 2-7 s of the tiny
# model), to hold fleet-x's only pool child or to freeze it mid-job.
RUNNING_ON_X = {"max_tokens": 4000, "ignore_eos": True, "model": "alpha", "host": "fleet-x"}
LONG_ON_X = {"prompt": "long", **RUNNING_ON_X}


@contextmanager
def x_busy(api: Api) -> Iterator[str]:
    """fleet-x's only pool child runs a long job (cancelled on the way out), so every other
    job pinned to fleet-x waits in its host queue."""
    job_id = api.submit(**LONG_ON_X)
    try:
        wait_until(lambda: api.get(f"/v1/jobs/{job_id}").json()["status"] == "running", 30, "x")
        yield job_id
    finally:
        api.post(f"/v1/jobs/{job_id}/cancel")
        api.wait_job(job_id)


def cancel_all(api: Api, job_ids: list[str]) -> None:
    for job_id in job_ids:
        api.post(f"/v1/jobs/{job_id}/cancel")


def test_jobs_run_on_a_live_host_that_serves_their_model(stack: Stack, fleet: TwoHosts) -> None:
    beta = stack.api.wait_job(stack.api.submit(prompt="b", max_tokens=4, model="beta"))
    assert beta["status"] == "succeeded"
    assert beta["host"] == "fleet-y" and beta["runner_id"] == "beta@fleet-y"
    alpha = [stack.api.submit(prompt=f"a{i}", max_tokens=4, model="alpha") for i in range(4)]
    assert {stack.api.wait_job(j)["host"] for j in alpha} <= {"fleet-x", "fleet-y"}
    pinned = stack.api.wait_job(
        stack.api.submit(prompt="p", max_tokens=4, model="alpha", host="fleet-x")
    )
    assert pinned["status"] == "succeeded" and pinned["runner_id"] == "alpha@fleet-x"


def test_an_unpinned_job_does_not_wait_behind_a_busy_host(stack: Stack, fleet: TwoHosts) -> None:
    with x_busy(stack.api) as long_id:
        started = time.monotonic()
        job = stack.api.wait_job(stack.api.submit(prompt="quick", max_tokens=8, model="alpha"))
        assert job["status"] == "succeeded" and job["host"] == "fleet-y"
        assert time.monotonic() - started < 10
        assert stack.api.get(f"/v1/jobs/{long_id}").json()["status"] == "running"


def test_a_model_no_live_host_serves_is_404_naming_the_served_models(
    stack: Stack, fleet: TwoHosts
) -> None:
    before = stack.store.redis.zcard("exo:jobs")
    response = stack.api.post("/v1/jobs", json={"prompt": "a", "model": "no-such-model"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert "no-such-model" in error["message"] and "not served by any live host" in error["message"]
    assert {"alpha", "beta", "tiny"} <= set(error["details"]["served_models"])
    assert all(m in error["message"] for m in ("alpha", "beta", "tiny"))
    assert stack.store.redis.zcard("exo:jobs") == before


def test_pinning_to_a_host_without_the_model_is_404(stack: Stack, fleet: TwoHosts) -> None:
    response = stack.api.post("/v1/jobs", json={"prompt": "a", "model": "beta", "host": "fleet-x"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["details"]["field"] == "host"
    assert "fleet-x" in error["message"] and "beta" in error["message"]


def test_a_stopped_runner_is_503_and_a_stopped_host_is_404(
    stack: Stack, processes: Processes, tmp_path: Path
) -> None:
    delta = create_model("tiny", tmp_path / "delta")
    worker = start_worker(processes, stack.redis.url, "fleet-z", [delta], tmp_path)
    wait_runner_ready(stack.store, worker, "delta")
    api = stack.api
    assert api.wait_job(api.submit(prompt="d", max_tokens=4, model="delta"))["host"] == "fleet-z"

    assert api.post("/v1/runners/delta@fleet-z/shutdown", json={"mode": "hard"}).status_code == 202
    wait_until(
        lambda: api.get("/v1/runners/delta@fleet-z").json()["status"] == "Shutdown", 10, "stop"
    )
    down = api.post("/v1/jobs", json={"prompt": "d", "model": "delta"})
    assert down.status_code == 503
    assert "every runner for model 'delta' is down" in down.json()["error"]["message"]

    assert api.post("/v1/runners", json={"model": "delta"}).status_code == 202
    wait_runner_ready(stack.store, worker, "delta")
    assert api.wait_job(api.submit(prompt="d", max_tokens=4, model="delta"))["status"] == (
        "succeeded"
    )

    assert api.post("/v1/hosts/fleet-z/shutdown", json={"mode": "warm"}).status_code == 202
    worker.process.wait(timeout=30)
    gone = api.post("/v1/jobs", json={"prompt": "d", "model": "delta"})
    assert gone.status_code == 404
    assert "delta" not in gone.json()["error"]["details"]["served_models"]


def host_entry(api: Api, name: str) -> dict[str, Any]:
    hosts: dict[str, dict[str, Any]] = {h["name"]: h for h in api.get("/v1/hosts").json()}
    assert name in hosts, sorted(hosts)
    return hosts[name]


def test_hosts_lists_live_workers_with_pid_runners_and_queue_depths(
    stack: Stack, fleet: TwoHosts
) -> None:
    started = time.monotonic()
    hosts = {h["name"]: h for h in stack.api.get("/v1/hosts").json()}
    assert time.monotonic() - started < 3
    assert {"host-a", "fleet-x", "fleet-y"} <= set(hosts)
    x, y = hosts["fleet-x"], hosts["fleet-y"]
    assert x["node"] == "exo@fleet-x" and x["pid"] == fleet.x.pid and x["concurrency"] == 1
    assert y["pid"] == fleet.y.pid and y["models"] == ["alpha", "beta"]
    assert [r["id"] for r in x["runners"]] == ["alpha@fleet-x"]
    assert {r["id"] for r in y["runners"]} == {"alpha@fleet-y", "beta@fleet-y"}
    assert set(x["queues"]) == {"exo.host.fleet-x", "exo.model.alpha"}
    with x_busy(stack.api):
        queued = [stack.api.submit(**LONG_ON_X) for _ in range(2)]
        try:
            assert host_entry(stack.api, "fleet-x")["queues"]["exo.host.fleet-x"] == 2
        finally:
            cancel_all(stack.api, queued)


def test_a_full_queue_is_429_with_retry_after(
    stack: Stack, fleet: TwoHosts, tmp_path: Path
) -> None:
    queued: list[str] = []
    settings = api_settings(stack.redis.url, [tmp_path / "alpha"], max_queued_jobs=2)
    with serving(settings) as api, x_busy(api):
        try:
            queued = [api.submit(**LONG_ON_X) for _ in range(2)]
            full = api.post("/v1/jobs", json=LONG_ON_X)
            assert full.status_code == 429
            assert full.headers["Retry-After"] == "5"
            error = full.json()["error"]
            assert error["type"] == "queue_full" and "EXO_MAX_QUEUED_JOBS=2" in error["message"]
            assert error["details"] == {"retry_after_s": 5}
            # Another queue is not full: an unpinned job is still taken.
            other = api.post("/v1/jobs", json={"prompt": "b", "max_tokens": 2, "model": "beta"})
            assert other.status_code == 202
        finally:
            cancel_all(api, queued)


def test_a_client_at_its_quota_is_429_even_before_a_streams_first_byte_while_others_are_taken(
    stack: Stack, fleet: TwoHosts, tmp_path: Path
) -> None:
    queued: list[str] = []
    settings = api_settings(stack.redis.url, [tmp_path / "alpha"], max_queued_jobs_per_client=2)
    heavy = {**LONG_ON_X, "user": "heavy"}
    with serving(settings) as api, x_busy(api):
        try:
            queued = [api.submit(**heavy) for _ in range(2)]
            over = api.post("/v1/jobs", json=heavy)
            assert over.status_code == 429 and over.headers["Retry-After"] == "5"
            error = over.json()["error"]
            assert error["type"] == "client_quota_full"
            assert "user 'heavy' has 2 jobs waiting" in error["message"]
            assert "EXO_MAX_QUEUED_JOBS_PER_CLIENT=2" in error["message"]
            body = {"model": "alpha", "prompt": "s", "max_tokens": 2, "stream": True, **heavy}
            streamed = api.post("/v1/completions", json=body, stream=True)
            assert streamed.status_code == 429 and streamed.headers["Retry-After"] == "5"
            assert "EXO_MAX_QUEUED_JOBS_PER_CLIENT=2" in streamed.text
            # Other clients: another user, and one named by its address (no user given).
            queued.append(api.submit(**{**heavy, "user": "light"}))
            queued.append(api.submit(**LONG_ON_X))
        finally:
            cancel_all(api, queued)


def test_a_high_priority_job_overtakes_queued_normal_ones(stack: Stack, fleet: TwoHosts) -> None:
    short = {**LONG_ON_X, "max_tokens": 4}
    with x_busy(stack.api):
        low = stack.api.submit(**short, priority="low")
        normal = [stack.api.submit(**short) for _ in range(3)]
        high = stack.api.submit(**short, priority="high")
    jobs = {j: stack.api.wait_job(j) for j in [low, *normal, high]}
    assert all(job["status"] == "succeeded" for job in jobs.values())
    started = {j: job["started_at"] for j, job in jobs.items()}
    assert started[high] < min(started[n] for n in normal)
    assert max(started[n] for n in normal) < started[low]


# --- prefix-aware routing (exo_tasks.prefix_routing): alpha is served by fleet-x and fleet-y ---


def first_turn(api: Api, index: int, host: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A conversation's first turn, run on `host`: its job, and the messages of its second."""
    messages = [{"role": "user", "content": f"Conversation {index}: what is a job queue?"}]
    job = api.wait_job(api.submit(messages=messages, max_tokens=8, model="alpha", host=host))
    assert job["status"] == "succeeded"
    answer = {"role": "assistant", "content": job["output"]["text"]}
    second = [*messages, answer, {"role": "user", "content": "And what is a host?"}]
    # The runner wrote it with the job's end: no wait, or a client's next turn would race it.
    assert next_turns_host(api, second) == host
    return job, second


def next_turns_host(api: Api, messages: list[dict[str, Any]]) -> str | None:
    """The host the map of prefixes names for a turn of these messages of alpha."""
    digests = prompt_digests(JobRequest.model_validate({"messages": messages, "model": "alpha"}))
    return last_host(api.app.extensions["exo"].store.hosts.prefix_hosts("alpha", digests))


def routed(before: Samples, after: Samples, outcome: str) -> float:
    """Jobs of alpha that prefix routing sent to a host (routed) or not (fallback) meanwhile."""
    name, labels = "exo_prefix_routed_total", {"model": "alpha", "outcome": outcome}
    return value(after, name, **labels) - value(before, name, **labels)


def host_is_idle(stack: Stack, host: str) -> bool:
    state = stack.store.hosts.get(host)
    runner = runner_state(stack.store, host, "alpha")
    return state is not None and not state.held and runner.active_jobs == 0


def alpha_worker(
    stack: Stack, fleet: TwoHosts, processes: Processes, tmp_path: Path, host: str
) -> Worker:
    """A third host serving alpha, ready."""
    alpha = Path(fleet.x.env["EXO_MODELS"])
    return new_worker(processes, stack.redis.url, stack.store, host, [alpha], tmp_path)


def test_the_next_turn_of_a_conversation_runs_on_the_host_that_ran_the_last(
    stack: Stack, fleet: TwoHosts
) -> None:
    # Not alternating: sequential jobs in the model's queue tend to alternate between hosts.
    hosts = ["fleet-x", "fleet-x", "fleet-y", "fleet-x", "fleet-y", "fleet-y"]
    turns = [first_turn(stack.api, i, host) for i, host in enumerate(hosts)]
    before = scrape(stack.api.url)
    for host, (first, messages) in zip(hosts, turns, strict=True):
        # A user's next turn: its host published within a second that it finished the last job.
        wait_until(functools.partial(host_is_idle, stack, host), 1, f"{host} idle")
        job = stack.api.wait_job(stack.api.submit(messages=messages, max_tokens=8, model="alpha"))
        assert job["status"] == "succeeded" and job["host"] == host
        # Its runner's prompt cache held the conversation's first turn.
        cached = job["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= first["usage"]["prompt_tokens"] - 1, (cached, first["usage"])
    assert routed(before, scrape(stack.api.url), "routed") == len(hosts)


def test_a_turns_host_is_recorded_by_its_runner_with_its_end_while_its_task_is_frozen(
    stack: Stack, fleet: TwoHosts
) -> None:
    """The pool child that follows a job used to record its prefixes after it saw the end, so a
    client that sent its next turn at once could be routed without them. Frozen here from the
    job's first token until the job has ended, it records nothing: the runner did, with the
    end."""
    messages = [{"role": "user", "content": "Conversation 30: what does a pool child hold?"}]
    job_id = stack.api.submit(messages=messages, **RUNNING_ON_X)
    streamed = lambda: stack.store.streams.streamed_text(job_id)[1] > 0  # noqa: E731
    wait_until(streamed, 30, "the job's first token")
    children = pool_children(fleet.x)
    for child in children:
        child.suspend()
    try:
        frozen = stack.store.jobs.get(job_id)
        assert frozen is not None and frozen.status == "running", "it ended before the freeze"
        job = stack.api.wait_job(job_id)
        assert job["status"] == "succeeded" and job["host"] == "fleet-x"
        answer = {"role": "assistant", "content": job["output"]["text"]}
        second = [*messages, answer, {"role": "user", "content": "And what is a host?"}]
        assert next_turns_host(stack.api, second) == "fleet-x"
    finally:
        for child in children:
            child.resume()
    wait_until(functools.partial(host_is_idle, stack, "fleet-x"), 10, "fleet-x idle")
    job = stack.api.wait_job(stack.api.submit(messages=second, max_tokens=8, model="alpha"))
    assert job["status"] == "succeeded" and job["host"] == "fleet-x"


def test_a_hosts_published_load_follows_its_jobs_within_a_second(
    stack: Stack, fleet: TwoHosts
) -> None:
    # Routing reads it: a host whose finished job still showed would lose the next turn.
    def holds() -> bool:
        state = stack.store.hosts.get("fleet-x")
        return state is not None and bool(state.held)

    for _ in range(3):
        with x_busy(stack.api):
            wait_until(holds, 1, "fleet-x's job in its heartbeat")
        wait_until(lambda: host_is_idle(stack, "fleet-x"), 1, "fleet-x idle in its heartbeat")


def test_a_turn_whose_host_is_saturated_runs_on_another_at_once(
    stack: Stack, fleet: TwoHosts
) -> None:
    _, messages = first_turn(stack.api, 10, "fleet-x")
    before = scrape(stack.api.url)
    with x_busy(stack.api) as long_id:  # fleet-x's one pool child is taken
        x_load = lambda: runner_state(stack.store, "fleet-x", "alpha").active_jobs  # noqa: E731
        wait_until(x_load, 10, "fleet-x's load published")
        started = time.monotonic()
        job = stack.api.wait_job(stack.api.submit(messages=messages, max_tokens=8, model="alpha"))
        assert job["status"] == "succeeded" and job["host"] == "fleet-y"
        assert time.monotonic() - started < 10
        assert stack.api.get(f"/v1/jobs/{long_id}").json()["status"] == "running"
    after = scrape(stack.api.url)
    assert (routed(before, after, "fallback"), routed(before, after, "routed")) == (1, 0)


def test_a_turn_sent_to_a_host_killed_meanwhile_runs_on_another_within_the_heartbeat(
    stack: Stack, fleet: TwoHosts, processes: Processes, tmp_path: Path
) -> None:
    worker = alpha_worker(stack, fleet, processes, tmp_path, "fleet-w")
    _, messages = first_turn(stack.api, 20, "fleet-w")
    runner = stack.store.runners.get(runner_id_for("alpha", "fleet-w"))
    worker.process.kill()
    worker.process.wait(timeout=10)
    # Its runner outlives it until it notices (its lifeline): meanwhile a job handed to it
    # as it is submitted (exo_tasks.direct) would run there. Gone, it runs nothing.
    assert runner is not None and runner.pid is not None
    wait_until(lambda: not psutil.pid_exists(runner.pid), 10, "fleet-w's runner gone")
    started = time.monotonic()
    job_id = stack.api.submit(messages=messages, max_tokens=8, model="alpha")
    # Its heartbeat has not expired yet: the job's prefix sent it to the dead host's queue.
    assert stack.store.redis.hget(job_key(job_id), "queue") == "exo.host.fleet-w"
    job = stack.api.wait_job(job_id, timeout_s=HEARTBEAT_TTL_S + 30)
    assert job["status"] == "succeeded" and job["host"] in ("fleet-x", "fleet-y")
    assert time.monotonic() - started < HEARTBEAT_TTL_S + 10


def test_a_job_its_prefix_sent_to_a_runner_stopped_since_goes_to_the_models_queue(
    stack: Stack, fleet: TwoHosts, processes: Processes, tmp_path: Path
) -> None:
    alpha_worker(stack, fleet, processes, tmp_path, "fleet-v")
    stop = stack.api.post("/v1/runners/alpha@fleet-v/shutdown", json={"mode": "hard"})
    assert stop.status_code == 202
    stopped = lambda: runner_state(stack.store, "fleet-v", "alpha").status == "Shutdown"  # noqa: E731
    wait_until(stopped, 10, "fleet-v's runner stopped")
    # Routed by its prefix to fleet-v just before the stop: unpinned, in fleet-v's own queue.
    request = JobRequest.model_validate({"prompt": "hello", "max_tokens": 4})
    job = JobRecord(id=jobs.new_job_id(), model="alpha", request=request)
    stack.store.jobs.create(job, host_queue("fleet-v"), max_queued=1_000)
    context = stack.api.app.extensions["exo"]
    jobs.send(context.celery, context.settings, job, host_queue("fleet-v"))
    # Not sent back to fleet-v's queue again and again: to the model's, which other hosts serve.
    done = stack.api.wait_job(job.id, timeout_s=30)
    assert done["status"] == "succeeded" and done["host"] in ("fleet-x", "fleet-y")
    assert stack.store.redis.hget(job_key(job.id), "queue") == "exo.model.alpha"
