"""An instance's records, id and state machine, pure: no Redis, no processes."""

from __future__ import annotations

import itertools

import pytest
from pydantic import ValidationError

from exo_tasks import instances, jobs, lifecycle
from exo_tasks.fleet_types import RunnerStatus
from exo_tasks.instances import (
    INSTANCE_TRANSITIONS,
    IllegalMove,
    InstanceRecord,
    InstanceRequest,
    InstanceStatus,
    ShutdownMode,
)
from exo_tasks.naming import instance_of_runner, instance_queue, instance_runner_id, runner_id_for
from exo_tasks.types import JobRecord, JobRequest

P, ST, R = InstanceStatus.PENDING, InstanceStatus.STARTING, InstanceStatus.READY
SD, D, F = InstanceStatus.SHUTTING_DOWN, InstanceStatus.SHUTDOWN, InstanceStatus.FAILED

# The whole table, written out: every (from, to) pair not here is refused.
ALLOWED = {
    (P, ST), (P, D), (P, F),
    (ST, R), (ST, SD), (ST, F),
    (R, SD), (R, F),
    (SD, SD), (SD, D), (SD, F),
    (D, P), (F, P),
}  # fmt: skip


def placed(**update: object) -> InstanceRecord:
    record = InstanceRecord.placed("/models/tiny", ["a", "b"], "tensor")
    return record.model_copy(update=update)


def test_every_status_has_its_moves() -> None:
    assert set(INSTANCE_TRANSITIONS) == set(InstanceStatus)


@pytest.mark.parametrize(("current", "to"), list(itertools.product(InstanceStatus, repeat=2)))
def test_the_transitions_table(current: InstanceStatus, to: InstanceStatus) -> None:
    allowed = (current, to) in ALLOWED
    assert instances.may_move(current, to) is allowed
    record = placed(status=current, shutdown_mode="warm" if current is SD else None)
    if not allowed:
        with pytest.raises(IllegalMove):
            instances.move(record, to)
        return
    made = instances.move(record, to, error="x" if to is F else None)
    assert made.record.status is to and current in made.allowed_from
    assert made.generation == record.generation  # applied only to the generation it read


def test_failed_is_reachable_from_every_live_status_and_only_pending_leaves_the_final_ones() -> (
    None
):
    assert instances.allowed_from(F) == instances.LIVE
    assert instances.allowed_from(P) == (D, F)
    assert all(INSTANCE_TRANSITIONS[s] == {P} for s in (D, F))


def test_a_restart_is_a_new_generation_with_fresh_ranks() -> None:
    record = placed()
    ranked = record.model_copy(
        update={"ranks": [r.model_copy(update={"pid": 7, "status": "Ready"}) for r in record.ranks]}
    )
    failed = instances.move(ranked, F, error="rank 1 on host b: Terminated (signal 9 SIGKILL)")
    assert failed.record.error and failed.record.generation == 1
    again = instances.move(failed.record, P)
    assert again.record.generation == 2 and again.generation == 1
    assert again.record.error is None and again.record.shutdown_mode is None
    assert [(r.rank, r.host, r.pid, r.status) for r in again.record.ranks] == [
        (0, "a", None, RunnerStatus.WAITING_FOR_MODEL),
        (1, "b", None, RunnerStatus.WAITING_FOR_MODEL),
    ]


def test_a_shutdown_records_its_mode_stops_a_pending_one_at_once_and_can_be_made_hard() -> None:
    assert instances.shutdown(placed(), "warm").record.status is D  # no rank runs yet
    ready = instances.shutdown(placed(status=R), "warm")
    assert ready.record.status is SD and ready.record.shutdown_mode == "warm"
    assert ready.allowed_from == (R,)
    hard = instances.shutdown(ready.record, "hard")
    assert hard.record.shutdown_mode == "hard" and hard.allowed_from == (SD,)
    again: list[tuple[InstanceRecord, ShutdownMode]] = [
        (ready.record, "warm"),
        (hard.record, "hard"),
        (hard.record, "warm"),
    ]
    for record, mode in again:
        with pytest.raises(IllegalMove, match="already shutting down"):
            instances.shutdown(record, mode)
    for final in (D, F):
        with pytest.raises(IllegalMove, match=f"is {final}"):
            instances.shutdown(placed(status=final), "hard")


def test_the_id_is_the_same_for_the_same_placement_and_differs_otherwise() -> None:
    one = InstanceRecord.placed("/x/models/Tiny", ["a", "b"], "tensor")
    # Another host's path to the same model names the same instance.
    assert one.id == InstanceRecord.placed("/y/tiny", ["a", "b"], "tensor").id
    assert one.id.startswith("inst-tiny-") and one.model == "tiny"
    others = [
        InstanceRecord.placed("/x/tiny", ["b", "a"], "tensor"),
        InstanceRecord.placed("/x/tiny", ["a", "b"], "pipeline"),
        InstanceRecord.placed("/x/tiny", ["a", "b", "c"], "tensor"),
        InstanceRecord.placed("/x/other", ["a", "b"], "tensor"),
    ]
    assert len({one.id, *(o.id for o in others)}) == 5


def test_ranks_are_named_by_their_instance_and_rank_and_jobs_have_the_instances_queue() -> None:
    record = placed()
    assert [r.runner_id for r in record.ranks] == [
        instance_runner_id(record.id, 0),
        instance_runner_id(record.id, 1),
    ]
    assert [instance_of_runner(r.runner_id) for r in record.ranks] == [record.id, record.id]
    # A runner of a whole model is none of an instance's, whatever its model's name.
    for whole in ("tiny@a", "inst-m.rank1@a", "m.rank1", runner_id_for("tiny", "b")):
        assert instance_of_runner(whole) is None
    assert instance_queue(record.id) == f"exo.instance.{record.id}"


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"model": "m", "hosts": ["a"]}, "hosts", "at least 2"),
        ({"model": "m", "hosts": ["a", "b", "a"]}, "hosts", "'a' is listed twice"),
        ({"model": "m", "hosts": ["a", ""]}, "hosts.1", "at least 1"),
        ({"model": "m", "hosts": ["a", "b,c"]}, "hosts.1", "pattern"),
        ({"model": "m", "hosts": ["a", "b"], "parallel": "data"}, "parallel", "tensor"),
        ({"model": "", "hosts": ["a", "b"]}, "model", "at least 1"),
        ({"model": "m", "hosts": ["a", "b"], "extra": 1}, "extra", "Extra"),
    ],
)
def test_a_request_names_what_is_wrong(body: dict[str, object], field: str, message: str) -> None:
    with pytest.raises(ValidationError) as raised:
        InstanceRequest.model_validate(body)
    error = raised.value.errors()[0]
    assert ".".join(map(str, error["loc"])) == field and message in error["msg"]


def test_a_request_defaults_to_tensor_parallel() -> None:
    request = InstanceRequest.model_validate({"model": "m", "hosts": ["a", "b"]})
    assert request.parallel == "tensor"


def test_a_requeued_job_of_an_instance_goes_back_to_the_instances_queue() -> None:
    request = JobRequest.model_validate({"prompt": "hi", "max_tokens": 4})
    job = JobRecord(id="j", model="m", request=request, instance="inst-m-0123abcd")
    again = lifecycle.requeue(job).record
    assert again.instance == job.instance and again.attempts == 1
    assert jobs.queue_of(again) == instance_queue("inst-m-0123abcd")
    assert jobs.queue_of(again.model_copy(update={"instance": None})) == "exo.model.m"
