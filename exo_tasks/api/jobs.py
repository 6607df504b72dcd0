"""Jobs: submit, look up, list, and stream tokens as server-sent events."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, jsonify, request, stream_with_context

from config.celery import PRIORITY_LEVELS
from config.settings import model_slug
from exo_tasks.api.context import ApiContext, ctx
from exo_tasks.celery_app import INFERENCE_TASK
from exo_tasks.errors import InvalidRequest, NotFound
from exo_tasks.types import (
    TERMINAL_JOB_STATUSES,
    DoneEvent,
    JobRecord,
    JobRequest,
    host_queue,
    model_queue,
    runner_id_for,
)

bp = Blueprint("jobs", __name__, url_prefix="/v1/jobs")
SSE_BLOCK_MS = 1000
KEEPALIVE = ": keepalive\n\n"


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


def resolve_model(context: ApiContext, requested: str | None) -> str:
    """The served model a request names (by slug or by path), or the default one."""
    configured = [model_slug(m) for m in context.settings.served_models]
    if requested is None:
        return configured[0]
    served = dict.fromkeys(configured + [r.model for r in context.store.list_runners()])
    for candidate in (requested, model_slug(requested)):
        if candidate in served:
            return candidate
    raise NotFound(
        f"model '{requested}' is not served; served models: {', '.join(served)}",
        {"field": "model", "served_models": list(served)},
    )


def submit_job(context: ApiContext, job_request: JobRequest) -> JobRecord:
    """Record the job, then send its task: a job the API accepted is never unknown."""
    settings = context.settings
    model = resolve_model(context, job_request.model)
    queue = model_queue(model)
    if job_request.host is not None:
        # Pinned: the host's own queue, which only that host's worker consumes.
        if context.store.get_runner(runner_id_for(model, job_request.host)) is None:
            raise InvalidRequest(
                f"host '{job_request.host}' does not serve model '{model}'", {"field": "host"}
            )
        queue = host_queue(job_request.host)
    job = JobRecord(id=uuid.uuid4().hex, model=model, request=job_request)
    context.store.create_job(job)
    soft = job_request.timeout_s or settings.job_soft_time_limit_s
    context.celery.send_task(
        INFERENCE_TASK,
        args=[job.id],
        task_id=job.id,
        queue=queue,
        # Celery takes float seconds here; its stubs say int.
        soft_time_limit=soft,  # type: ignore[arg-type]
        time_limit=soft + settings.job_hard_grace_s,  # type: ignore[arg-type]
        priority=PRIORITY_LEVELS[job_request.priority],
    )
    return job


def parse_job_request(context: ApiContext, body: dict[str, Any]) -> JobRequest:
    return JobRequest.model_validate(body, context={"max_tokens_cap": context.settings.max_tokens})


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
    job = ctx().store.get_job(job_id)
    if job is None:
        raise NotFound(f"no job '{job_id}'", {"job_id": job_id})
    return job


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
        position = after
        while True:
            batch = store.read_events(job_id, position, block_ms=SSE_BLOCK_MS)
            if not batch:
                yield KEEPALIVE
                continue
            for event_id, event in batch:
                position = event_id
                data = (
                    public(event.job)
                    if isinstance(event, DoneEvent)
                    else event.model_dump(exclude={"event"})
                )
                yield f"id: {event_id}\nevent: {event.event}\ndata: {json.dumps(data)}\n\n"
                if isinstance(event, DoneEvent):
                    return

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return Response(stream_with_context(events()), mimetype="text/event-stream", headers=headers)
