"""The instance service, with no HTTP in it: place an instance once its placement is checked,
stop one, and place those EXO_INSTANCES names when a worker starts. The routes and the worker
go through here; each host's supervisor runs the ranks (exo_tasks.worker)."""

from __future__ import annotations

import logging

from config.settings import Settings
from exo_tasks import instances, placement
from exo_tasks.errors import Conflict, ExoError, NotFound
from exo_tasks.fleet import Fleet
from exo_tasks.instances import IllegalMove, InstanceRecord, InstanceRequest, ShutdownMode
from exo_tasks.store import Store

log = logging.getLogger("exo_tasks.instances")
# A shutdown re-reads an instance that another writer moved meanwhile, at most this often.
SHUTDOWN_TRIES = 5


def planned(settings: Settings, request: InstanceRequest) -> InstanceRecord:
    """The instance `request` places, if its model is known and splits that way over that many
    hosts (404 or 422 naming why, else)."""
    source = placement.find_source(request.model, settings.served_models)
    placement.check_split(request.model, source.config, request.parallel, len(request.hosts))
    return InstanceRecord.placed(source.path, request.hosts, request.parallel)


def check_hosts_live(fleet: Fleet, hosts: list[str]) -> None:
    """404 naming every host that has no live worker (no heartbeat)."""
    dead = [host for host in hosts if host not in fleet.hosts]
    if dead:
        live = ", ".join(fleet.hosts) or "none"
        raise NotFound(
            f"no live worker on host {', '.join(repr(h) for h in dead)} (no heartbeat); "
            f"live hosts: {live}",
            {"field": "hosts", "hosts": dead},
        )


def place(
    store: Store, settings: Settings, fleet: Fleet, request: InstanceRequest
) -> InstanceRecord:
    """POST /v1/instances: the instance, placed (or as it is, if placed before and live)."""
    record = planned(settings, request)
    check_hosts_live(fleet, request.hosts)
    placed, created = store.instances.place(record)
    if created:
        log.info(
            "instance placed",
            extra={"instance": placed.id, "hosts": ",".join(placed.hosts), "model": placed.model},
        )
    return placed


def place_configured(store: Store, settings: Settings) -> list[InstanceRecord]:
    """The instances EXO_INSTANCES names, placed when this worker starts: the same on every
    worker that lists them (the id is deterministic), and their hosts need not be live yet.
    An entry that cannot work is logged and skipped: the worker serves the rest."""
    placed = []
    for request in settings.configured_instances:
        try:
            placed.append(store.instances.place(planned(settings, request))[0])
        except ExoError as exc:
            log.error(
                "EXO_INSTANCES entry skipped: %s",
                exc.message,
                extra={"model": request.model, "hosts": ",".join(request.hosts)},
            )
    return placed


def get_or_404(store: Store, instance_id: str) -> InstanceRecord:
    record = store.instances.get(instance_id)
    if record is None:
        raise NotFound(f"no instance '{instance_id}'", {"instance_id": instance_id})
    return record


def shutdown(store: Store, instance_id: str, mode: ShutdownMode) -> InstanceRecord:
    """Stop an instance: its supervisors see it ShuttingDown with `mode` and stop its ranks
    (warm: drained first). 404 unknown, 409 already stopping (in that mode) or stopped."""
    for _ in range(SHUTDOWN_TRIES):
        record = get_or_404(store, instance_id)
        try:
            stop = instances.shutdown(record, mode)
        except IllegalMove as exc:
            raise Conflict(str(exc), {"status": record.status}) from None
        if store.instances.apply(stop):
            log.info("instance shutting down", extra={"instance": instance_id, "mode": mode})
            return stop.record
    raise Conflict(f"instance '{instance_id}' kept changing; try again", {"status": None})
