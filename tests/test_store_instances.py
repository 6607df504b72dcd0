"""The store's instance part on a real redis-server: placing (idempotent, and again once
stopped), compare-and-set transitions, rank records and ring addresses of one generation."""

from __future__ import annotations

import uuid

from exo_tasks import instances
from exo_tasks.fleet_types import RunnerStatus
from exo_tasks.instances import InstanceRecord, InstanceStatus
from exo_tasks.store import Store

P, ST, R = InstanceStatus.PENDING, InstanceStatus.STARTING, InstanceStatus.READY
SD, D, F = InstanceStatus.SHUTTING_DOWN, InstanceStatus.SHUTDOWN, InstanceStatus.FAILED


def new_instance() -> InstanceRecord:
    """An instance of its own model, so tests sharing the session's Redis never meet."""
    return InstanceRecord.placed(f"/models/m-{uuid.uuid4().hex[:8]}", ["a", "b"], "tensor")


def test_placing_twice_returns_the_instance_placed_first(store: Store) -> None:
    record = new_instance()
    assert store.instances.place(record) == (record, True)
    started = store.instances.transition(record.id, ST)
    assert started is not None
    again, created = store.instances.place(new_instance().model_copy(update={"id": record.id}))
    assert not created and again.status is ST and again.model == record.model
    assert store.instances.get(record.id) == started
    assert record.id in {i.id for i in store.instances.all()}
    store.instances.remove(record.id)
    assert store.instances.get(record.id) is None
    assert record.id not in {i.id for i in store.instances.all()}


def test_a_stopped_instance_placed_again_is_pending_in_its_next_generation(store: Store) -> None:
    record = new_instance()
    store.instances.place(record)
    for status in (ST, F):
        assert store.instances.transition(record.id, status, error="rank 1 on host b: gone")
    failed = store.instances.get(record.id)
    assert failed is not None and failed.error == "rank 1 on host b: gone"
    again, created = store.instances.place(record)
    assert created and again.status is P and again.generation == 2 and again.error is None
    assert store.instances.get(record.id) == again


def test_a_transition_is_compare_and_set_on_status_and_generation(store: Store) -> None:
    record = new_instance()
    store.instances.place(record)
    # Not in the table: nothing written.
    assert store.instances.transition(record.id, R) is None
    assert store.instances.transition(record.id, ST, generation=2) is None
    starting = store.instances.transition(record.id, ST, generation=1)
    assert starting is not None and starting.status is ST
    # A shutdown made from the record read before a rank failed it is refused.
    stale = instances.shutdown(starting, "warm")
    assert store.instances.transition(record.id, F, error="rank 0 on host a: exitcode=1")
    assert not store.instances.apply(stale)
    # Nor a move to Ready from the Starting it read; nor, once placed again, one of the
    # generation before.
    assert not store.instances.apply(instances.move(starting, R))
    again, _ = store.instances.place(record)
    assert not store.instances.apply(instances.move(starting, F, error="late"))
    current = store.instances.get(record.id)
    assert current == again and current.status is P and current.generation == 2
    shutdown = instances.shutdown(current, "hard")
    assert store.instances.apply(shutdown)
    stopped = store.instances.get(record.id)
    assert stopped is not None and stopped.status is D and stopped.shutdown_mode == "hard"
    assert store.instances.transition("inst-none-00000000", ST) is None
    store.instances.remove(record.id)


def test_rank_records_and_addresses_hold_for_one_generation_only(store: Store) -> None:
    record = new_instance()
    store.instances.place(record)
    rank1 = record.ranks[1].model_copy(
        update={"pid": 42, "status": RunnerStatus.LOADING, "weights_bytes": 1000}
    )
    assert store.instances.set_rank(record.id, 1, rank1)
    assert store.instances.publish_address(record.id, 1, 1, "10.0.0.2", 52100)
    assert store.instances.publish_address(record.id, 1, 0, "10.0.0.1", 52101)
    assert store.instances.addresses(record.id, 1) == {
        0: ("10.0.0.1", 52101),
        1: ("10.0.0.2", 52100),
    }
    got = store.instances.get(record.id)
    assert got is not None and got.ranks[1] == rank1 and got.ranks[0] == record.ranks[0]

    store.instances.transition(record.id, ST)
    store.instances.transition(record.id, F, error="rank 0 on host a: exitcode=1")
    again, _ = store.instances.place(record)
    # The old generation's ranks and addresses are gone; its late writes are refused.
    assert (
        store.instances.addresses(record.id, 2) == {}
        and store.instances.addresses(record.id, 1) == {}
    )
    assert not store.instances.set_rank(record.id, 1, rank1)
    assert not store.instances.publish_address(record.id, 1, 1, "10.0.0.2", 52100)
    got = store.instances.get(record.id)
    assert got is not None and got.ranks == again.ranks and got.ranks[1].pid is None
    assert store.instances.set_rank(record.id, 2, rank1)
    store.instances.remove(record.id)


def test_a_rank_record_changed_since_it_was_read_is_not_overwritten(store: Store) -> None:
    """A supervisor mirrors its rank from a read of the instance; when the rank's exit was
    settled (Shutdown) between that read and the write, a stale "not running" overwrote it
    (test_instance_stack, once in CI)."""
    record = new_instance()
    store.instances.place(record)
    running = record.ranks[0].model_copy(update={"pid": 7, "status": RunnerStatus.RUNNING})
    assert store.instances.set_rank(record.id, 1, running)
    read = store.instances.get(record.id)
    assert read is not None
    shutdown = running.model_copy(update={"pid": None, "status": RunnerStatus.SHUTDOWN})
    assert store.instances.set_rank(record.id, 1, shutdown)  # the exit, settled meanwhile
    stale = running.model_copy(
        update={"pid": None, "status": RunnerStatus.FAILED, "error": "not running"}
    )
    assert not store.instances.set_rank(record.id, 1, stale, seen=read.ranks[0].status)
    got = store.instances.get(record.id)
    assert got is not None and got.ranks[0] == shutdown
    # Unchanged since it was read (or never written): written.
    assert store.instances.set_rank(record.id, 1, stale, seen=RunnerStatus.SHUTDOWN)
    never_written = record.ranks[1].model_copy(update={"pid": 7})
    assert store.instances.set_rank(record.id, 1, never_written, seen=RunnerStatus.LOADING)
    got = store.instances.get(record.id)
    assert got is not None and got.ranks[0] == stale and got.ranks[1].pid == 7
    store.instances.remove(record.id)
