"""How a rank's worker settles a rank's exit in its instance's records
(exo_tasks.worker.ranks.RankKeeper), on a real redis-server."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any, cast

from config.settings import Settings
from exo_tasks.fleet_types import HostState
from exo_tasks.instances import InstanceRecord, InstanceStatus
from exo_tasks.runner.process import RunnerSpec
from exo_tasks.store import Store
from exo_tasks.types import utcnow
from exo_tasks.worker.ranks import RankKeeper
from exo_tasks.worker.supervision import RunnerHandle


def test_a_rank_stopped_as_hung_fails_its_instance_even_when_it_exits_cleanly(
    store: Store,
) -> None:
    """A rank stopped for a stall may exit 0: its stop request reached it once it was no
    longer blocked. That exit once counted as a clean one: the instance stayed Ready with its
    rank gone, and never started again."""
    unique = uuid.uuid4().hex[:8]
    hosts = [f"a-{unique}", f"b-{unique}"]
    for host in hosts:  # both alive: no host of its own is named as the cause instead
        store.hosts.publish(HostState(name=host, pid=1, models=[], started_at=utcnow()), 60)
    placed = InstanceRecord.placed(f"/models/m-{unique}", hosts, "tensor")
    store.instances.place(placed)
    for status in (InstanceStatus.STARTING, InstanceStatus.READY):
        assert store.instances.transition(placed.id, status)
    settings = Settings(_env_file=None, hostname=hosts[1], models="tiny")
    handle = RunnerHandle(RunnerSpec.for_rank(placed, 1, "/models/m", settings))
    handle.stall = "stalled in decode (no token for 5.0s)"
    supervisor = cast(Any, SimpleNamespace())
    keeper = RankKeeper(settings, store, supervisor, lambda *_: None)
    keeper._on_exit(handle, 0, f"{handle.stall}; exitcode=0")
    record = store.instances.get(placed.id)
    assert record is not None and record.status is InstanceStatus.FAILED, record
    cause = "stalled in decode (no token for 5.0s); exitcode=0"
    assert record.error == f"rank 1 on host {hosts[1]}: {cause}"
    assert record.ranks[1].status == "Failed"
    store.instances.remove(placed.id)
    for host in hosts:
        store.hosts.remove(host)
