"""Hosts that are live to the API (their heartbeat is in Redis, as a worker publishes it) with
no worker behind them: an instance placed on them is moved by nothing but the test, which
stands for their supervisors. For the tests of what the API and routing make of each of an
instance's statuses; a host's liveness itself is tested with real workers."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

from exo_tasks.fleet_types import HostState, RunnerState
from exo_tasks.instances import InstanceStatus
from exo_tasks.store import Store, runner_key
from exo_tasks.store.keys import RUNNERS
from exo_tasks.types import utcnow

# Longer than any test that holds them; removed at its end anyway.
HELD_TTL_S = 300.0


def held_incarnation(host: str) -> str:
    """The incarnation a held host beats with: a job a test hands over there names it as its
    owner, so the recovery loop sees its owner live (and leaves it running)."""
    return f"{host}:{os.getpid()}:0"


@contextlib.contextmanager
def held_hosts(store: Store, *hosts: str, models: Sequence[str] = ()) -> Iterator[list[str]]:
    """`hosts`, beating for the block's duration, each announcing it serves `models` whole."""
    for host in hosts:
        state = HostState(
            name=host,
            pid=os.getpid(),
            incarnation=held_incarnation(host),
            models=list(models),
            started_at=utcnow(),
        )
        store.hosts.publish(state, HELD_TTL_S)
    try:
        yield list(hosts)
    finally:
        for host in hosts:
            store.hosts.remove(host)


def move_instance(
    store: Store, instance_id: str, *statuses: InstanceStatus, error: str | None = None
) -> None:
    """The instance moved through `statuses` as its hosts' supervisors would move it."""
    for status in statuses:
        assert store.instances.transition(instance_id, status, error=error), status


@contextlib.contextmanager
def held_runner(store: Store, state: RunnerState) -> Iterator[RunnerState]:
    """A runner's state published as its supervisor publishes it, on a held host, and gone
    (state, history, its place in the runner list) at the block's end."""
    store.runners.publish(state)
    try:
        yield state
    finally:
        store.redis.srem(RUNNERS, state.id)
        store.redis.delete(runner_key(state.id), runner_key(state.id, "history"))
