"""The direct hand-over (EXO_DIRECT_HAND_OVER): a job whose runner has room goes into that
runner's inbox as it is submitted, and its Celery message to that runner's host's own queue.
The task, once delivered there, follows the job it finds running (lifecycle.Delivery.FOLLOW):
Celery's limits, revocation, Flower's view and the recovery loop hold as for any job, and the
job's first step does not wait for Celery's delivery and a pool child's hand-over (half of a
1-token job's queue overhead: docs/benchmarks.md).

The job is held by the host's worker incarnation from the start, as if its task had handed it
over: a worker that dies before its task is delivered has it requeued by the recovery loop; a
runner that stops requeues or fails it as any job of its own. A runner takes a job directly only
while it holds fewer than a full batch, and its host's runners together fewer than the host's
pool children (checked again in the hand-over's own script): past that, jobs wait in Celery's
queue, in its priority order, as before."""

from __future__ import annotations

import time
from dataclasses import dataclass

from config.settings import Settings
from exo_tasks import lifecycle, limits, prefix_routing
from exo_tasks.commands import SubmitJob
from exo_tasks.fleet import Fleet
from exo_tasks.naming import runner_id_for
from exo_tasks.store import Store
from exo_tasks.store.client import ScriptCall
from exo_tasks.store.runners import Room
from exo_tasks.types import JobRecord


@dataclass(frozen=True)
class DirectRunner:
    """A runner with room for a job now, the worker incarnation that will hold the job, and
    the room the hand-over checks again in Redis (the fleet read may be a moment old)."""

    runner_id: str
    host: str
    owner: str
    room: Room


def pick(fleet: Fleet, settings: Settings, model: str, host: str | None) -> DirectRunner | None:
    """The runner for `model` (on `host`, if the job must go there) that takes jobs now and
    holds the fewest, if one has room (prefix_routing.can_take); None when the setting is off."""
    if not settings.direct_hand_over:
        return None
    hosts = [host] if host is not None else list(fleet.hosts)
    capacity = settings.completion_batch_size
    with_room = [
        fleet.runners[runner_id_for(model, h)]
        for h in hosts
        if prefix_routing.can_take(fleet, model, h, 0, capacity) and fleet.hosts[h].incarnation
    ]
    if not with_room:
        return None
    runner = min(with_room, key=lambda r: r.active_jobs)
    state = fleet.hosts[runner.host]
    on_host = tuple(r.id for r in fleet.host_runners(state.name))
    room = Room(capacity, state.concurrency or capacity, on_host)
    return DirectRunner(runner.id, state.name, state.incarnation, room)


def handing(store: Store, settings: Settings, job: JobRecord, runner: DirectRunner) -> ScriptCall:
    """The hand-over of the job just created to `runner`, running and held by its host's
    worker, with its deadlines from now: a script call to run with the job's creation
    (Store.create), which hands nothing over if the runner or its host has no room left."""
    started = lifecycle.start(
        job, host=runner.host, runner_id=runner.runner_id, owner=runner.owner, direct=True
    )
    soft_deadline, deadline = limits.job_limits(job.request.timeout_s, settings).deadlines(
        time.time()
    )
    command = SubmitJob(job=started, soft_deadline=soft_deadline, deadline=deadline)
    return store.runners.handing(runner.runner_id, command, runner.room)
