"""The job service, with no HTTP in it: parse a job request, resolve its model, submit it
(record, then send its Celery message), cancel it. The native and the OpenAI-compatible routes
and the recovery loop all go through here; the API follows a job's events through
exo_tasks.api.streams."""

from __future__ import annotations

import enum
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery import Celery
from kombu.exceptions import KombuError
from redis import RedisError

from config.celery import PRIORITY_LEVELS
from config.settings import Settings
from exo_tasks import direct, lifecycle, limits, metrics, prefix_routing, task_results
from exo_tasks.celery_app import INFERENCE_TASK, ExoCelery
from exo_tasks.commands import CancelJob
from exo_tasks.direct import DirectRunner
from exo_tasks.errors import ClientQuotaFull, Conflict, NotFound, QueueFull
from exo_tasks.fairness import Client
from exo_tasks.fleet import Fleet
from exo_tasks.naming import (
    find_model,
    host_of_queue,
    host_queue,
    instance_queue,
    model_queue,
    model_slug,
)
from exo_tasks.store import Store
from exo_tasks.types import JobRecord, JobRequest, JobStatus

log = logging.getLogger("exo_tasks.jobs")
QUEUE_FULL_RETRY_AFTER_S = 5


def parse_request(settings: Settings, body: dict[str, Any]) -> JobRequest:
    """A job request, validated against the configured caps (pydantic's ValidationError)."""
    caps = {
        "max_tokens_cap": settings.max_tokens,
        "max_prompt_chars": settings.max_prompt_chars,
        "max_prompt_tokens": settings.max_prompt_tokens,
        "max_stop_chars": settings.max_stop_chars,
        "max_timeout_s": limits.max_timeout_s(settings),
    }
    return JobRequest.model_validate(body, context=caps)


def resolve_model(fleet: Fleet, settings: Settings, requested: str | None) -> str:
    """The model a request names (by slug or by path), or this API's default one; 404 unless a
    live host serves it."""
    name = requested if requested is not None else settings.served_models[0]
    served = fleet.models
    model = find_model(name, served)
    if model is None:
        # The default model by its slug: its path is the server's business, not the client's.
        named = (
            f"model '{name}'"
            if requested is not None
            else f"the default model '{model_slug(name)}'"
        )
        raise NotFound(
            f"{named} is not served by any live host; served models: {', '.join(served) or 'none'}",
            {"field": "model", "served_models": served},
        )
    return model


def new_job_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Route:
    """Where a job goes: its model (as served), its queue, the instance that serves it (None
    for a model runners hold whole), and the runner that takes it as it is submitted, if one has
    room (exo_tasks.direct; `queue` is then that runner's host's own)."""

    model: str
    queue: str
    instance: str | None = None
    direct: DirectRunner | None = None


def route(
    fleet: Fleet, settings: Settings, request: JobRequest, store: Store | None = None
) -> Route:
    """Where `request` goes in `fleet`, or why it cannot go now: 404 for a model or host no
    live host serves, 503 when every runner that could take it is down (or every instance of a
    model only instances serve cannot take it: fleet.instance_for), 400 for tools the model
    cannot call. Checked before a stream's first byte, so a client's mistake keeps its
    status. A full queue's 429 comes from the job's creation (submit), or for a stream from
    refuse_if_full before its first byte. With `store`, an unpinned job may go to the host
    that ran its prompt's prefix (exo_tasks.prefix_routing)."""
    model = resolve_model(fleet, settings, request.model)
    instance = fleet.instance_for(model, request.host)
    queue = instance_queue(instance.id) if instance else fleet.queue_for(model, request.host)
    if request.tools:
        fleet.refuse_tools_unless_supported(model)
    if instance is not None:
        return Route(model, queue, instance.id)
    if store is not None and request.host is None:
        queue = _queue_by_prefix(store, fleet, settings, model, request) or queue
    runner = direct.pick(fleet, settings, model, host_of_queue(queue))
    if runner is not None:
        return Route(model, host_queue(runner.host), direct=runner)
    return Route(model, queue)


def _queue_by_prefix(
    store: Store, fleet: Fleet, settings: Settings, model: str, request: JobRequest
) -> str | None:
    """The queue of the host that ran the longest prefix of the prompt, if it can take the job
    now. Looked up only where the choice exists: two live hosts serving the model or more."""
    if settings.prefix_routing_ttl_s <= 0 or sum(fleet.serves(h, model) for h in fleet.hosts) < 2:
        return None
    digests = prefix_routing.prompt_digests(request)
    host = prefix_routing.last_host(store.hosts.prefix_hosts(model, digests)) if digests else None
    if host is None:
        return None
    queue = host_queue(host)
    waiting = store.jobs.queue_depth(queue)
    routed = prefix_routing.can_take(fleet, model, host, waiting, settings.completion_batch_size)
    counted = metrics.Observations()
    counted.inc(metrics.PREFIX_ROUTED, model=model, outcome="routed" if routed else "fallback")
    store.metrics.write(counted)
    return queue if routed else None


def refuse_if_full(queue: str, depth: int, settings: Settings) -> None:
    """429 once `depth` messages wait in `queue`, EXO_MAX_QUEUED_JOBS or more."""
    if depth >= settings.max_queued_jobs:
        raise QueueFull(
            f"{depth} jobs are waiting in {queue}, the most allowed "
            f"(EXO_MAX_QUEUED_JOBS={settings.max_queued_jobs})",
            retry_after_s=QUEUE_FULL_RETRY_AFTER_S,
        )


def refuse_over_quota(client: Client, waiting: int, settings: Settings) -> None:
    """429 once `client` has EXO_MAX_QUEUED_JOBS_PER_CLIENT jobs waiting, or more."""
    quota = settings.max_queued_jobs_per_client
    if waiting >= quota:
        raise ClientQuotaFull(
            f"{client.label} has {waiting} jobs waiting, the most one client may have "
            f"(EXO_MAX_QUEUED_JOBS_PER_CLIENT={quota}); other clients' jobs are still taken",
            retry_after_s=QUEUE_FULL_RETRY_AFTER_S,
        )


def submit(
    store: Store,
    celery: Celery,
    settings: Settings,
    request: JobRequest,
    job_id: str | None = None,
    where: Route | None = None,
    *,
    client: Client,
    later: Callable[[str, int], None] | None = None,
) -> JobRecord:
    """Record the job, then send its task: a job the API accepted is never unknown. A pinned
    job goes to its host's own queue, which only that host's worker consumes. Once
    EXO_MAX_QUEUED_JOBS jobs wait in the queue, or EXO_MAX_QUEUED_JOBS_PER_CLIENT of its
    `client`'s, 429: the client backs off, Redis does not fill up, other clients go on. The job
    waits at the step of its priority class its client's waiting jobs give it (fairness.py).
    `job_id`: one chosen beforehand (new_job_id), already given to the client; `where`: its
    route, if already found; `client`: who sent it (exo_tasks.fairness). A job its route gives
    a runner with room is handed to it before its message is sent (exo_tasks.direct); `later`
    (the API's), given the job id and its priority step, has send_direct_task run once a short
    job's task is due (direct.task_due): without it, the task is sent at once."""
    where = where or route(Fleet.load(store), settings, request, store)
    job = JobRecord(
        id=job_id or new_job_id(), model=where.model, request=request, instance=where.instance
    )
    quota = settings.max_queued_jobs_per_client
    creation = store.jobs.creation(job, where.queue, settings.max_queued_jobs, client.key, quota)
    task_due = direct.task_due(settings, request) if later is not None else 0
    handing = direct.handing(store, settings, job, where.direct, task_due) if where.direct else None
    admitted, handed = store.create(creation, handing)
    # Counted as the job was created: these hold.
    refuse_if_full(where.queue, admitted.depth, settings)
    refuse_over_quota(client, admitted.client_waiting, settings)
    assert admitted.step is not None, "a job refused by neither count was created"
    queue = where.queue
    if handing is not None and not handed:
        # Its runner filled up since the fleet was read: the job waits in Celery's queue.
        queue = queue_of(job)
        store.jobs.set_queue(job.id, queue)
    if handed and later is not None and task_due:
        later(job.id, admitted.step)
    else:
        send(celery, settings, job, queue, admitted.step)
    return job


def send_direct_task(
    store: Store, celery: ExoCelery, settings: Settings, job_id: str, step: int | None = None
) -> bool:
    """The task of a job handed over directly, once due, if nobody took it first
    (Store.direct_tasks): a job that has succeeded meanwhile has its task stored SUCCESS and
    announced (exo_tasks.task_results), with no message: most short jobs, which so cost no
    Celery round trip. Any other job's message is sent to its queue as it would have been at
    once: its task follows the job, or finds it ended and ends as it did. False if another
    took it first, or the job is gone."""
    claimed, job, queue = store.direct_tasks.claim(job_id)
    if not claimed or job is None:
        return False
    queue = queue or queue_of(job)
    if job.status == JobStatus.SUCCEEDED:
        task_results.announce_succeeded(celery, job, queue)
    else:
        send(celery, settings, job, queue, step)
    return True


def queue_of(job: JobRecord) -> str:
    """The queue a job goes back to: its instance's, its pinned host's own, or its model's (any
    host serving it). A job routed by its prefix to a host's queue is not pinned: it comes back
    here."""
    if job.instance is not None:
        return instance_queue(job.instance)
    return host_queue(job.request.host) if job.request.host else model_queue(job.model)


def resend(store: Store, celery: Celery, settings: Settings, job: JobRecord) -> None:
    """Send a queued job's message again, to queue_of(job), at the step it was given, and
    record that queue as the one its message is in (the recovery loop looks for it there)."""
    queue = queue_of(job)
    store.jobs.set_queue(job.id, queue)
    send(celery, settings, job, queue, store.jobs.queue_priority(job.id))


def send(
    celery: Celery, settings: Settings, job: JobRecord, queue: str, step: int | None = None
) -> None:
    """Send the job's `inference` message to `queue`, with its time limits, at priority step
    `step` (None: its class's first). The task id is the job id, so Celery's and Flower's
    views name the job."""
    job_limits = limits.job_limits(job.request.timeout_s, settings)
    if step is None:
        step = PRIORITY_LEVELS[job.request.priority]
    celery.send_task(
        INFERENCE_TASK,
        args=[job.id, job.model],
        task_id=job.id,
        queue=queue,
        # Celery takes float seconds here; its stubs say int.
        soft_time_limit=job_limits.soft_s,  # type: ignore[arg-type]
        time_limit=job_limits.hard_s,  # type: ignore[arg-type]
        priority=step,
    )


def get_or_404(store: Store, job_id: str) -> JobRecord:
    return found_or_404(store.jobs.get(job_id), job_id)


def found_or_404(job: JobRecord | None, job_id: str) -> JobRecord:
    """The job `job_id` as read (None: there is none, 404)."""
    if job is None:
        raise NotFound(f"no job '{job_id}'", {"job_id": job_id})
    return job


class CancelledBy(enum.StrEnum):
    """Who cancelled a job, as its task in Flower says why it ended."""

    API = "cancelled through the API"
    REVOKE = "revoked in Flower (or by celery control revoke)"
    CLIENT_GONE = "cancelled: its streaming client went away or fell behind"
    WAIT_ENDED = "cancelled: its request's wait ran past the job's time limits"
    BATCH = "cancelled with its batch"


def _revoke_queued(celery: Celery, job_id: str) -> None:
    """Celery's revoke of the job's task, to every worker: one of them withdraws its message,
    which would otherwise wait in its queue until a worker took it, and announces the task
    REVOKED (exo_tasks.worker.revocation). The job is cancelled already: should this fail, the
    first worker to take the message drops it and says so."""
    try:
        celery.control.revoke(job_id)
    except (KombuError, RedisError) as exc:
        log.warning("revoke not sent", extra={"job_id": job_id, "error": str(exc)})


def cancel(store: Store, job_id: str, by: CancelledBy, *, celery: Celery | None) -> JobRecord:
    """Cancel a job, for `by`. A queued job ends `cancelled` at once and never runs; a running
    one is ended by its runner at the next step with its partial text (the runner keeps its
    model). A running job whose worker is gone is ended here, and a cancel is final: no later
    attempt of the job runs. Returns the job as it is now. `celery`: to tell the workers of a
    queued job's cancel (None: the caller is a worker handling that very revoke)."""
    job = get_or_404(store, job_id)
    if not job.is_terminal:
        # First, so that an attempt that ends by requeue from now on ends cancelled instead.
        store.jobs.request_cancel(job_id, by)
        job = get_or_404(store, job_id)
    while job.status == JobStatus.QUEUED:
        move = lifecycle.cancel_queued(job)
        if store.jobs.apply(move):
            if celery is not None:
                _revoke_queued(celery, job_id)
            return move.record
        job = get_or_404(store, job_id)  # a runner took it meanwhile, or it ended
    if job.is_terminal:
        raise Conflict(f"job '{job_id}' is already {job.status}", {"status": job.status})
    assert job.runner_id is not None, "a running job always names its runner"
    if not store.hosts.owner_is_live(job):
        text, tokens = store.streams.streamed_text(job_id)
        move = lifecycle.cancel_orphaned(job, text, tokens)
        if store.jobs.apply(move):
            return move.record
        return get_or_404(store, job_id)
    store.runners.send(job.runner_id, CancelJob(job_id=job_id, reason="cancelled"))
    return job
