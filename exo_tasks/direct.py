"""The direct hand-over (EXO_DIRECT_HAND_OVER): a job whose runner has room goes into that
runner's inbox as it is submitted, and its Celery message to that runner's host's own queue.
The task, once delivered there, follows the job it finds running (lifecycle.Delivery.FOLLOW):
Celery's limits, revocation, Flower's view and the recovery loop hold as for any job, and the
job's first step does not wait for Celery's delivery and a pool child's hand-over (half of a
1-token job's queue overhead: docs/benchmarks.md). A short job's message is sent
EXO_DIRECT_TASK_DELAY_MS after the hand-over (task_due; jobs.send_direct_task), and not at all
if the job has succeeded by then: its task is stored SUCCESS and announced
(exo_tasks.task_results). Celery's work for a task, done on the same cores as the model, was
the rest of a 1-token job's overhead; the runner holds the job's time limits from the
hand-over.

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
from exo_tasks.types import JobRecord, JobRequest

# The jobs whose task may wait (task_due): those of at most as many tokens as OpenAI's default
# for a completion. Such a job holds no pool child until its task is delivered,
# so a queued job may take the child meanwhile and its host run one job more than its pool for
# a moment; a short job mostly ends first and never needs one. A longer job's task is sent at
# once: it holds its child, and tasks queued behind it wait, from its hand-over.
SHORT_JOB_TOKENS = 16


def task_due(settings: Settings, request: JobRequest) -> float:
    """When the task of a job about to be handed over directly is due (a Unix time): a short
    job's, EXO_DIRECT_TASK_DELAY_MS from now; 0 (sent at once) for any other, or with no delay."""
    if request.max_tokens > SHORT_JOB_TOKENS or not settings.direct_task_delay_ms:
        return 0
    return time.time() + settings.direct_task_delay_ms / 1000


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


def handing(
    store: Store, settings: Settings, job: JobRecord, runner: DirectRunner, task_due: float
) -> ScriptCall:
    """The hand-over of the job just created to `runner`, running and held by its host's
    worker, with its deadlines from now: a script call to run with the job's creation
    (Store.create), which hands nothing over if the runner or its host has no room left.
    `task_due`: when its task is due (Store.direct_tasks), 0 if it is sent at once."""
    started = lifecycle.start(
        job, host=runner.host, runner_id=runner.runner_id, owner=runner.owner, direct=True
    )
    soft_deadline, deadline = limits.job_limits(job.request.timeout_s, settings).deadlines(
        time.time()
    )
    command = SubmitJob(job=started, soft_deadline=soft_deadline, deadline=deadline)
    return store.runners.handing(runner.runner_id, command, runner.room, task_due)
