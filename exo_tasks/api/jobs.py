"""Jobs: submit, look up, list, cancel, and stream tokens as server-sent events."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, jsonify, request, stream_with_context

from config.settings import model_slug
from exo_tasks import jobs, limits
from exo_tasks.api.context import ApiContext, ctx
from exo_tasks.api.fleet import Fleet
from exo_tasks.errors import InvalidRequest, NotFound, QueueFull
from exo_tasks.store import Store
from exo_tasks.types import (
    TERMINAL_JOB_STATUSES,
    DoneEvent,
    JobEvent,
    JobRecord,
    JobRequest,
)

bp = Blueprint("jobs", __name__, url_prefix="/v1/jobs")
SSE_BLOCK_MS = 1000
KEEPALIVE = ": keepalive\n\n"
QUEUE_FULL_RETRY_AFTER_S = 5


def json_body(*, allow_empty: bool = False) -> dict[str, Any]:
    """The request's JSON object; `allow_empty`: a missing body means `{}` (all defaults)."""
    if allow_empty and not request.get_data():
        return {}
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object", {"field": None})
    return body


def public(job: JobRecord) -> dict[str, Any]:
    return job.model_dump(mode="json")


def resolve_model(context: ApiContext, requested: str | None, fleet: Fleet | None = None) -> str:
    """The model a request names (by slug or by path), or this API's default one; 404 unless a
    live host serves it."""
    fleet = fleet or Fleet.load(context.store)
    name = requested if requested is not None else context.settings.served_models[0]
    served = fleet.models
    for candidate in (name, model_slug(name)):
        if candidate in served:
            return candidate
    raise NotFound(
        f"model '{name}' is not served by any live host; served models: "
        f"{', '.join(served) or 'none'}",
        {"field": "model", "served_models": served},
    )


def submit_job(context: ApiContext, job_request: JobRequest) -> JobRecord:
    """Record the job, then send its task: a job the API accepted is never unknown. A pinned
    job goes to its host's own queue, which only that host's worker consumes. Once
    EXO_MAX_QUEUED_JOBS jobs wait in the queue, 429: the client backs off, Redis does not
    fill up."""
    settings = context.settings
    fleet = Fleet.load(context.store)
    model = resolve_model(context, job_request.model, fleet)
    queue = fleet.queue_for(model, job_request.host)
    job = JobRecord(id=uuid.uuid4().hex, model=model, request=job_request)
    depth = context.store.create_job(job, queue, settings.max_queued_jobs)
    if depth >= settings.max_queued_jobs:
        raise QueueFull(
            f"{depth} jobs are waiting in {queue}, the most allowed "
            f"(EXO_MAX_QUEUED_JOBS={settings.max_queued_jobs})",
            retry_after_s=QUEUE_FULL_RETRY_AFTER_S,
        )
    jobs.send(context.celery, settings, job)
    return job


def parse_job_request(context: ApiContext, body: dict[str, Any]) -> JobRequest:
    caps = {
        "max_tokens_cap": context.settings.max_tokens,
        "max_prompt_chars": context.settings.max_prompt_chars,
        "max_timeout_s": limits.max_timeout_s(context.settings),
    }
    return JobRequest.model_validate(body, context=caps)


@bp.post("")
def create_job() -> tuple[Response, int]:
    context = ctx()
    job = submit_job(context, parse_job_request(context, json_body()))
    return jsonify(public(job)), 202


@bp.get("")
def list_jobs() -> Response:
    status = request.args.get("status")
    if status is not None and status not in {"queued", "running", *TERMINAL_JOB_STATUSES}:
        raise InvalidRequest(f"unknown status '{status}'", {"field": "status"})
    limit = request.args.get("limit", "50")
    if not limit.isdigit() or not 1 <= int(limit) <= 1000:
        raise InvalidRequest("limit must be an integer from 1 to 1000", {"field": "limit"})
    jobs = ctx().store.list_jobs(status=status, limit=int(limit))
    return jsonify([public(job) for job in jobs])


def get_or_404(job_id: str) -> JobRecord:
    return jobs.get_or_404(ctx().store, job_id)


@bp.get("/<job_id>")
def get_job(job_id: str) -> Response:
    return jsonify(public(get_or_404(job_id)))


@bp.get("/<job_id>/stream")
def stream_job(job_id: str) -> Response:
    """Tokens as `event: token`, then `event: done` (or `error`) with the job. Each event's
    `id:` is its stream position, so `Last-Event-ID` resumes without loss or repetition."""
    get_or_404(job_id)
    after = request.headers.get("Last-Event-ID") or request.args.get("last_event_id") or "0-0"
    store = ctx().store

    def events() -> Iterator[str]:
        for item in follow_events(store, job_id, after):
            if item is None:
                yield KEEPALIVE
                continue
            event_id, event = item
            data = (
                public(event.job)
                if isinstance(event, DoneEvent)
                else event.model_dump(exclude={"event"})
            )
            yield f"id: {event_id}\nevent: {event.event}\ndata: {json.dumps(data)}\n\n"

    return sse_response(events())


def follow_events(
    store: Store, job_id: str, after: str = "0-0"
) -> Iterator[tuple[str, JobEvent] | None]:
    """A job's events after stream position `after`, up to its last (DoneEvent); None for
    each second without one, so a streaming caller can write a keepalive."""
    while True:
        batch = store.read_events(job_id, after, block_ms=SSE_BLOCK_MS)
        if not batch:
            yield None
        for event_id, event in batch:
            after = event_id
            yield event_id, event
            if isinstance(event, DoneEvent):
                return


def sse_response(chunks: Iterator[str]) -> Response:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return Response(stream_with_context(chunks), mimetype="text/event-stream", headers=headers)


@bp.post("/<job_id>/cancel")
def cancel(job_id: str) -> tuple[Response, int]:
    """202 with the job: `cancelled` if it was queued, else still `running` until its runner's
    next step ends it."""
    return jsonify(public(jobs.cancel(ctx().store, job_id))), 202
