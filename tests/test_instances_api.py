"""The instance routes on the real API and Redis, with live heartbeats from real workers (the
two-worker fleet, fleet-x and fleet-y, and the stack's host-a): a placement is checked before
anything is placed (model, split, heads, hosts live) and is idempotent; EXO_INSTANCES is placed
by a worker at start. What a shutdown does in each status is tested on held hosts
(tests/support/held_hosts.py), where the test moves the instance, standing for the hosts'
supervisors (on the fleet's, the runtime moves it as soon as it is placed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from exo_tasks import instance_service
from exo_tasks.instances import InstanceRecord, InstanceStatus
from exo_tasks.naming import instance_queue
from exo_tasks.store import Store
from tests.support.api import Api, api_settings
from tests.support.held_hosts import held_hosts, move_instance
from tests.support.processes import Processes
from tests.support.stack import Stack, TwoHosts, new_worker

XY = ["fleet-x", "fleet-y"]


def place(api: Api, placed: list[str], **body: Any) -> dict[str, Any]:
    response = api.post("/v1/instances", json=body)
    assert response.status_code == 202, response.text
    instance: dict[str, Any] = response.json()
    placed.append(instance["id"])
    return instance


def test_an_instance_is_placed_once_and_shows_each_rank(
    stack: Stack, fleet: TwoHosts, gamma_model: Path, placed: list[str]
) -> None:
    instance = place(stack.api, placed, model=str(gamma_model), hosts=XY)
    assert instance["id"].startswith("inst-gamma-")
    assert instance["status"] == "Pending" and instance["error"] is None
    assert instance["model"] == "gamma" and instance["model_path"] == str(gamma_model)
    assert instance["hosts"] == XY and instance["parallel"] == "tensor"
    assert instance["generation"] == 1 and instance["shutdown_mode"] is None
    ranks = [
        (r["rank"], r["host"], r["runner_id"], r["pid"], r["status"], r["weights_bytes"])
        for r in instance["ranks"]
    ]
    assert ranks == [
        (0, "fleet-x", f"{instance['id']}.rank0", None, "WaitingForModel", None),
        (1, "fleet-y", f"{instance['id']}.rank1", None, "WaitingForModel", None),
    ]
    # Its hosts' supervisors may have moved it since (Starting, Ready): the same instance.
    stable = ("id", "model", "model_path", "hosts", "parallel", "generation", "created_at")
    shown = stack.api.get(f"/v1/instances/{instance['id']}").json()
    assert {k: shown[k] for k in stable} == {k: instance[k] for k in stable}
    assert shown["status"] in ("Pending", "Starting", "Ready")
    listed = {i["id"]: i for i in stack.api.get("/v1/instances").json()}
    assert listed[instance["id"]]["created_at"] == instance["created_at"]

    # The same placement again (the model by another path to it): the same instance.
    again = place(stack.api, placed, model=f"{gamma_model}/", hosts=XY)
    assert {k: again[k] for k in stable} == {k: instance[k] for k in stable}

    # The fleet view: both hosts have a rank; rank 0's host consumes the instance's queue.
    hosts = {h["name"]: h for h in stack.api.get("/v1/hosts").json()}
    assert instance["id"] in hosts["fleet-x"]["instances"]
    assert instance["id"] in hosts["fleet-y"]["instances"]
    assert hosts["fleet-x"]["queues"][instance_queue(instance["id"])] == 0
    assert instance_queue(instance["id"]) not in hosts["fleet-y"]["queues"]


@pytest.mark.parametrize(
    ("body", "status", "field", "words"),
    [
        ({"model": "no-such-model", "hosts": XY}, 404, "model", "unknown model 'no-such-model'"),
        ({"model": "org/no hub id", "hosts": XY}, 404, "model", "unknown model 'org/no hub id'"),
        # A home directory of a user this host does not have (found by tests/chaos/test_fuzz).
        ({"model": "~0", "hosts": XY}, 404, "model", "unknown model '~0'"),
        # A NUL made the path checks raise: 500 (found by tests/chaos/test_fuzz).
        ({"model": "a\x00b", "hosts": XY}, 422, "model", "should match pattern"),
        ({"hosts": ["fleet-x", "ghost"]}, 404, "hosts", "no live worker on host 'ghost'"),
        ({"hosts": ["fleet-x", "fleet-x"]}, 422, "hosts", "'fleet-x' is listed twice"),
        ({"hosts": ["fleet-x"]}, 422, "hosts", "at least 2"),
        ({"hosts": XY, "parallel": "pipeline"}, 422, "parallel", "has no `model.pipeline`"),
        ({"hosts": XY, "parallel": "data"}, 422, "parallel", "'tensor' or 'pipeline'"),
        ({"hosts": [*XY, "host-a"]}, 422, "hosts", "4 attention heads: 3 tensor-parallel"),
        # The split is checked before the hosts: 4 ranks would split the heads, not the kv heads.
        ({"hosts": [*XY, "host-a", "ghost"]}, 422, "hosts", "2 key/value heads: 4 tensor"),
    ],
    ids=[
        "unknown-model",
        "invalid-hub-id",
        "unknown-user-home",
        "control-character",
        "dead-host",
        "duplicate-hosts",
        "one-host",
        "pipeline-on-llama",
        "unknown-split",
        "more-ranks-than-heads",
        "more-ranks-than-kv-heads",
    ],
)
def test_a_placement_that_cannot_work_is_refused_naming_why(
    stack: Stack,
    fleet: TwoHosts,
    gamma_model: Path,
    body: dict[str, Any],
    status: int,
    field: str,
    words: str,
) -> None:
    before = stack.api.get("/v1/instances").json()
    response = stack.api.post("/v1/instances", json={"model": str(gamma_model), **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"], error
    details = error["details"]
    named = details[0]["field"] if isinstance(details, list) else details["field"]
    assert named == field
    assert stack.api.get("/v1/instances").json() == before


def test_llama_is_refused_pipeline_parallel_naming_what_it_has(
    stack: Stack, fleet: TwoHosts, gamma_model: Path
) -> None:
    response = stack.api.post(
        "/v1/instances", json={"model": str(gamma_model), "hosts": XY, "parallel": "pipeline"}
    )
    assert response.json()["error"]["message"] == (
        f"model '{gamma_model}' cannot be split pipeline-parallel: mlx-lm's llama model has no "
        "`model.pipeline` (it has tensor)"
    )


def test_a_shutdown_moves_the_instance_as_its_state_allows(
    stack: Stack, gamma_model: Path, placed: list[str]
) -> None:
    api, store = stack.api, stack.store
    with held_hosts(store, "held-c", "held-d") as hosts:
        check_shutdowns(api, store, place(api, placed, model=str(gamma_model), hosts=hosts))


def check_shutdowns(api: Api, store: Store, instance: dict[str, Any]) -> None:
    path = f"/v1/instances/{instance['id']}/shutdown"
    # Pending: no rank runs yet, so it is stopped at once.
    stopped = api.post(path, json={"mode": "warm"})
    assert stopped.status_code == 202, stopped.text
    assert stopped.json()["status"] == "Shutdown" and stopped.json()["shutdown_mode"] == "warm"
    again = api.post(path, json={"mode": "hard"})
    assert again.status_code == 409 and "is Shutdown" in again.json()["error"]["message"]

    # Placed again: its next generation, Pending.
    restarted = place(api, [], model=instance["model_path"], hosts=instance["hosts"])
    assert restarted["status"] == "Pending" and restarted["generation"] == 2
    assert restarted["shutdown_mode"] is None
    move_instance(store, instance["id"], InstanceStatus.STARTING, InstanceStatus.READY)
    warm = api.post(path)  # no body: warm
    assert warm.status_code == 202
    assert warm.json()["status"] == "ShuttingDown" and warm.json()["shutdown_mode"] == "warm"
    assert api.post(path, json={"mode": "warm"}).status_code == 409
    hard = api.post(path, json={"mode": "hard"})
    assert hard.status_code == 202 and hard.json()["shutdown_mode"] == "hard"
    refused = api.post(path, json={"mode": "hard"})
    assert refused.status_code == 409
    assert refused.json()["error"]["message"].endswith("is already shutting down (hard)")
    stored = store.instances.get(instance["id"])
    assert stored is not None and stored.shutdown_mode == "hard"

    assert api.post(path, json={"mode": "cold"}).status_code == 422
    unknown = api.post("/v1/instances/inst-nope-00000000/shutdown")
    assert unknown.status_code == 404
    assert api.get("/v1/instances/inst-nope-00000000").status_code == 404


def test_exo_instances_are_placed_once_when_workers_start(
    stack: Stack,
    processes: Processes,
    tiny_model: Path,
    gamma_model: Path,
    tmp_path: Path,
    placed: list[str],
) -> None:
    spec = f"{gamma_model}@inst-a,inst-b;{gamma_model}@inst-a,inst-b:pipeline"
    expected = InstanceRecord.placed(str(gamma_model), ["inst-a", "inst-b"], "tensor")
    pipeline = InstanceRecord.placed(str(gamma_model), ["inst-a", "inst-b"], "pipeline")
    placed.extend([expected.id, pipeline.id])
    worker = new_worker(stack, processes, tiny_model, tmp_path, "inst-a", instances=spec)
    # Placed although inst-b has no worker yet: Pending until it has.
    record = stack.store.instances.get(expected.id)
    assert record is not None and record.status is InstanceStatus.PENDING and record.generation == 1
    assert (record.model, record.hosts, record.model_path) == (
        "gamma",
        ["inst-a", "inst-b"],
        str(gamma_model),
    )
    # An entry that cannot work is skipped, saying why; the worker serves the rest.
    assert stack.store.instances.get(pipeline.id) is None
    assert "EXO_INSTANCES entry skipped" in worker.log_text()
    assert "has no `model.pipeline`" in worker.log_text()

    # The other host's worker, with the same list, places nothing new.
    other = api_settings(stack.redis.url, [], instances=spec)
    again = instance_service.place_configured(stack.store, other)
    assert [(i.id, i.generation, i.created_at) for i in again] == [
        (record.id, 1, record.created_at)
    ]
