"""Jobs: submit, look up, list, cancel, and stream tokens as server-sent events."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

from flask import Blueprint, Response, jsonify, request, stream_with_context
from werkzeug.exceptions import RequestEntityTooLarge

from config.settings import model_slug
from exo_tasks import jobs, limits
from exo_tasks.api.context import ApiContext, ctx
from exo_tasks.api.fleet import Fleet
from exo_tasks.errors import BadRequest, InvalidRequest, NotFound, QueueFull
from exo_tasks.store import Store
from exo_tasks.types import (
    DoneEvent,
    JobEvent,
    JobRecord,
    JobRequest,
    JobStatus,
    JobSummary,
)

bp = Blueprint("jobs", __name__, url_prefix="/v1/jobs")
SSE_BLOCK_MS = 1000
KEEPALIVE = ": keepalive\n\n"
QUEUE_FULL_RETRY_AFTER_S = 5
MAX_LIST_LIMIT = 1000
# A Redis stream id: milliseconds, then optionally a sequence number, each an unsigned 64-bit.
STREAM_ID = re.compile(r"([0-9]{1,20})(?:-([0-9]{1,20}))?")


def json_body(*, allow_empty: bool = False) -> dict[str, Any]:
    """The request's JSON object; `allow_empty`: a missing body means `{}` (all defaults)."""
    if not _whole_body() and allow_empty:
        return {}
    try:
        body = request.get_json(silent=True)
    except RecursionError:  # Python's JSON parser recurses once per level
        raise BadRequest("the body is nested too deeply", {"field": None}) from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object", {"field": None})
    return body


def _whole_body() -> bytes:
    """The request body. Werkzeug stops reading a body without Content-Length (chunked) at the
    EXO_MAX_BODY_BYTES cap and hands over the part it read: a byte more means 413."""
    data = request.get_data()
    limit = request.max_content_length
    unsized = request.content_length is None and limit is not None and len(data) >= limit
    if unsized and request.environ["wsgi.input"].read(1):
        raise RequestEntityTooLarge()
    return data


def public(job: JobRecord) -> dict[str, Any]:
    return job.model_dump(mode="json")


def summary(job: JobRecord) -> dict[str, Any]:
    return JobSummary.of(job).model_dump(mode="json")


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
    settings = context.settings
    caps = {
        "max_tokens_cap": settings.max_tokens,
        "max_prompt_chars": settings.max_prompt_chars,
        "max_prompt_tokens": settings.max_prompt_tokens,
        "max_stop_chars": settings.max_stop_chars,
        "max_timeout_s": limits.max_timeout_s(settings),
    }
    return JobRequest.model_validate(body, context=caps)


@bp.post("")
def create_job() -> tuple[Response, int]:
    context = ctx()
    job = submit_job(context, parse_job_request(context, json_body()))
    return jsonify(summary(job)), 202


@bp.get("")
def list_jobs() -> Response:
    """Summaries of recent jobs, newest first. A full page links to the next one (`Link`,
    rel="next"): `before` is the id of the last job of the previous page."""
    status = request.args.get("status")
    if status is not None and status not in set(JobStatus):
        raise InvalidRequest(f"unknown status '{status}'", {"field": "status"})
    limit = _limit()
    before = request.args.get("before")
    listed = ctx().store.list_jobs(status=status, limit=limit, before=before)
    if listed is None:
        raise NotFound(f"no job '{before}' among the recent ones", {"field": "before"})
    response = jsonify([summary(job) for job in listed])
    if len(listed) == limit:
        query = {"limit": limit, "before": listed[-1].id} | ({"status": status} if status else {})
        response.headers["Link"] = f'<{request.path}?{urlencode(query)}>; rel="next"'
    return response


def _limit() -> int:
    raw = request.args.get("limit", "50")
    message = f"limit must be an integer from 1 to {MAX_LIST_LIMIT}"
    if not (raw.isascii() and raw.isdigit()):  # str.isdigit takes '²', which int() does not
        raise BadRequest(message, {"field": "limit"})
    if not 1 <= int(raw) <= MAX_LIST_LIMIT:
        raise InvalidRequest(message, {"field": "limit"})
    return int(raw)


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
    after = _resume_after()
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


def _resume_after() -> str:
    """Where a stream resumes, checked before Redis sees it (XREAD fails on a malformed id)."""
    field, raw = "Last-Event-ID", request.headers.get("Last-Event-ID")
    if not raw:
        field, raw = "last_event_id", request.args.get("last_event_id")
    if not raw:
        return "0-0"
    match = STREAM_ID.fullmatch(raw)
    if match is None or any(int(part or 0) >> 64 for part in match.groups()):
        shown = raw if len(raw) <= 40 else raw[:40] + "…"
        raise BadRequest(
            f"{field} '{shown}' is not a stream id (such as 1700000000000-0)", {"field": field}
        )
    return raw


def follow_events(
    store: Store, job_id: str, after: str = "0-0"
) -> Iterator[tuple[str, JobEvent] | None]:
    """A job's events after stream position `after`, up to its last (DoneEvent); None for
    each second without one, so a streaming caller can write a keepalive. A reader that
    resumed past the end of an ended job's stream gets its last event again."""
    while True:
        batch = store.read_events(job_id, after, block_ms=SSE_BLOCK_MS)
        if not batch:
            last = store.last_event(job_id)
            if last is not None and isinstance(last[1], DoneEvent):
                yield last
                return
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
