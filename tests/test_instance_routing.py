"""Routing to instances, on the real API and Redis: a model only an instance serves is listed by
/v1/models, counted by /readyz once Ready, and its jobs go to the instance's queue (pinned or
not); an instance that cannot take them makes them 503 naming why; a model some host serves
whole (the two-worker fleet's alpha) keeps going to its runners.

The instances are placed on held hosts (tests/support/held_hosts.py: live heartbeats, no
worker), so each status is the test's to set, standing for the hosts' supervisors; nothing
consumes such an instance's queue, so its jobs stay queued until cancelled."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exo_tasks import lifecycle
from exo_tasks.commands import SubmitJob
from exo_tasks.fleet_types import RunnerState, RunnerStatus
from exo_tasks.instances import InstanceRecord, InstanceStatus
from exo_tasks.naming import instance_queue, instance_runner_id, model_queue, runner_id_for
from exo_tasks.store import Store, job_key
from tests.support.api import Api
from tests.support.held_hosts import held_hosts, held_incarnation, held_runner, move_instance
from tests.support.metrics import scrape, value
from tests.support.processes import wait_until
from tests.support.stack import Stack, TwoHosts

HELD = ("held-a", "held-b")
JOB = {"prompt": "hi", "max_tokens": 4}
STARTING, READY = InstanceStatus.STARTING, InstanceStatus.READY
READY_RUNNER = RunnerStatus.READY
LOADING = RunnerStatus.LOADING


@pytest.fixture(autouse=True)
def held(store: Store) -> Iterator[None]:
    with held_hosts(store, *HELD):
        yield


def place(api: Api, placed: list[str], model: str) -> str:
    response = api.post("/v1/instances", json={"model": model, "hosts": list(HELD)})
    assert response.status_code == 202, response.text
    instance_id: str = response.json()["id"]
    placed.append(instance_id)
    return instance_id


def accepted_job(api: Api, **body: Any) -> dict[str, Any]:
    """A job accepted for a model an instance serves, still queued (no rank 0 takes it)."""
    response = api.post("/v1/jobs", json={**JOB, **body})
    assert response.status_code == 202, response.text
    job: dict[str, Any] = api.get(f"/v1/jobs/{response.json()['id']}").json()
    return job


def cancelled(api: Api, job: dict[str, Any]) -> dict[str, Any]:
    assert api.post(f"/v1/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
    return job


def queued_job(api: Api, **body: Any) -> dict[str, Any]:
    """A job accepted for a model an instance serves, cancelled (it would wait for rank 0)."""
    return cancelled(api, accepted_job(api, **body))


def refused(api: Api, **body: Any) -> tuple[int, str]:
    response = api.post("/v1/jobs", json={**JOB, **body})
    message: str = response.json()["error"]["message"]
    return response.status_code, message


def test_a_model_only_an_instance_serves_is_listed_and_its_jobs_go_to_its_queue(
    stack: Stack, gamma_model: Path, placed: list[str]
) -> None:
    api, store = stack.api, stack.store
    instance_id = place(api, placed, str(gamma_model))
    cards = {card["id"]: card for card in api.get("/v1/models").json()["data"]}
    assert cards["gamma"]["hosts"] == list(HELD) and cards["gamma"]["instances"] == [instance_id]
    assert api.get("/v1/models/gamma").status_code == 200

    queue = instance_queue(instance_id)
    depth = store.jobs.queue_depth(queue)
    job = accepted_job(api, model="gamma")
    assert job["instance"] == instance_id and job["model"] == "gamma"
    assert store.redis.hget(job_key(job["id"]), "queue") == queue
    assert store.jobs.queue_depth(queue) == depth + 1
    # Cancelled, it waits in no queue: the workers' revoke withdraws its message.
    cancelled(api, job)
    wait_until(
        lambda: store.jobs.queue_depth(queue) == depth, timeout_s=10, what="its message withdrawn"
    )
    # Pinned to one of its hosts: the instance's queue too; to another host: none serves it.
    assert queued_job(api, model="gamma", host="held-b")["instance"] == instance_id
    status, message = refused(api, model="gamma", host="host-a")
    assert status == 404 and message == "no instance of model 'gamma' runs on host 'host-a'"

    # Ready once its supervisors say so: then /readyz counts it.
    assert instance_id not in api.get("/readyz").json()["ready_instances"]
    move_instance(store, instance_id, STARTING)
    assert instance_id not in api.get("/readyz").json()["ready_instances"]
    move_instance(store, instance_id, READY)
    ready = api.get("/readyz")
    assert ready.status_code == 200 and instance_id in ready.json()["ready_instances"]
    assert not any(r.startswith("inst-") for r in ready.json()["ready_runners"])


def test_jobs_an_instance_cannot_take_are_503_naming_why(
    stack: Stack, gamma_model: Path, placed: list[str]
) -> None:
    api, store = stack.api, stack.store
    instance_id = place(api, placed, str(gamma_model))
    cause = "rank 1 on host held-b: Terminated (signal 9 SIGKILL)"
    move_instance(store, instance_id, STARTING, InstanceStatus.FAILED, error=cause)
    status, message = refused(api, model="gamma")
    assert status == 503
    assert message == (
        f"model 'gamma' is served only by instances that cannot take jobs now: {instance_id} "
        f"is Failed ({cause}); it starts again once all its hosts are live"
    )
    assert "gamma" not in {card["id"] for card in api.get("/v1/models").json()["data"]}

    # Placed again: Pending on live hosts, it takes jobs (they wait for its ranks).
    place(api, placed, str(gamma_model))
    assert queued_job(api, model="gamma")["instance"] == instance_id
    move_instance(store, instance_id, STARTING, READY)
    assert api.post(f"/v1/instances/{instance_id}/shutdown").status_code == 202
    status, message = refused(api, model="gamma")
    assert status == 503 and message.endswith(f"{instance_id} is ShuttingDown")

    # Placed where a host has no heartbeat (EXO_INSTANCES does not wait for the hosts).
    waiting = InstanceRecord.placed("/elsewhere/delta", ["held-a", "ghost"], "tensor")
    store.instances.place(waiting)
    placed.append(waiting.id)
    status, message = refused(api, model="delta")
    assert status == 503
    assert message.endswith(f"{waiting.id} is Pending, waiting for host ghost (no heartbeat)")


def test_a_model_some_host_serves_whole_runs_on_its_runners_beside_an_instance(
    stack: Stack, fleet: TwoHosts, placed: list[str]
) -> None:
    alpha = fleet.x.env["EXO_MODELS"]
    instance_id = place(stack.api, placed, alpha)
    move_instance(stack.store, instance_id, STARTING, READY)
    job = stack.api.wait_job(stack.api.submit(model="alpha", **JOB))
    assert job["status"] == "succeeded" and job["instance"] is None
    assert job["runner_id"] in ("alpha@fleet-x", "alpha@fleet-y")
    cards = {card["id"]: card for card in stack.api.get("/v1/models").json()["data"]}
    hosts = ["fleet-x", "fleet-y", *HELD]  # whole, then the instance's
    assert cards["alpha"]["hosts"] == hosts and cards["alpha"]["instances"] == [instance_id]


def test_a_model_whose_whole_runners_are_all_down_goes_to_its_instance(
    stack: Stack, placed: list[str]
) -> None:
    api, store = stack.api, stack.store
    instance = InstanceRecord.placed("/elsewhere/omega", list(HELD), "tensor")
    store.instances.place(instance)
    placed.append(instance.id)
    move_instance(store, instance.id, STARTING, READY)
    # A held host serving omega whole, its runner loading (published as a supervisor does; a
    # Ready one would take the job as it is submitted, exo_tasks.direct, and nothing runs it).
    whole = RunnerState(
        id=runner_id_for("omega", "held-w"), host="held-w", model="omega", status=LOADING
    )
    with held_hosts(store, "held-w", models=["omega"]), held_runner(store, whole):
        job = queued_job(api, model="omega")
        assert job["instance"] is None
        assert store.redis.hget(job_key(job["id"]), "queue") == model_queue("omega")
        # Stopped for good: the instance takes the model's jobs.
        store.runners.publish(whole.model_copy(update={"status": RunnerStatus.SHUTDOWN}))
        assert queued_job(api, model="omega")["instance"] == instance.id


@pytest.fixture
def ready_gamma(stack: Stack, gamma_model: Path, placed: list[str]) -> str:
    """An instance of gamma on the held hosts, Ready."""
    instance_id = place(stack.api, placed, str(gamma_model))
    move_instance(stack.store, instance_id, STARTING, READY)
    return instance_id


def test_metrics_count_an_instances_jobs_for_its_model(stack: Stack, ready_gamma: str) -> None:
    api, store, instance_id = stack.api, stack.store, ready_gamma
    job_id = api.submit(model="gamma", **JOB)
    waiting = value(scrape(api.url), "exo_num_requests_waiting", model="gamma")
    assert waiting == store.jobs.queue_depth(instance_queue(instance_id)) >= 1
    # Handed to rank 0 as rank 0's host hands it over: running there.
    rank0 = instance_runner_id(instance_id, 0)
    job = store.jobs.get(job_id)
    assert job is not None
    owner = held_incarnation(HELD[0])
    running = lifecycle.start(job, host=HELD[0], runner_id=rank0, owner=owner)
    assert store.runners.hand_over(rank0, SubmitJob(job=running, soft_deadline=0, deadline=0))
    try:
        assert value(scrape(api.url), "exo_num_requests_running", model="gamma") == 1
    finally:
        store.runners.fail_jobs(rank0, "test over")


def test_tools_for_an_instance_whose_rank_0_has_no_tool_calling_are_refused(
    stack: Stack, ready_gamma: str
) -> None:
    api, store, instance_id = stack.api, stack.store, ready_gamma
    # Rank 0's runner, as it publishes itself once loaded: the model's template takes no tools.
    rank0 = RunnerState(
        id=instance_runner_id(instance_id, 0),
        host=HELD[0],
        model="gamma",
        status=READY_RUNNER,
        tool_calling=False,
    )
    with held_runner(store, rank0):
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        status, message = refused(api, model="gamma", tools=[tool])
        assert status == 422, message
        assert message == (
            "model 'gamma' does not support tools: its chat template has no tool calling"
        )
