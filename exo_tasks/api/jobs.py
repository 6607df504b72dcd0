"""Jobs: submit, look up, list, cancel, and stream tokens as server-sent events."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

import redis
from flask import Blueprint, Response, jsonify, request

from exo_tasks import jobs, progress
from exo_tasks.api import auth, streams
from exo_tasks.api.context import ctx
from exo_tasks.api.http import KEEPALIVE, json_body, sse_event, sse_response
from exo_tasks.api.models import JobSummary
from exo_tasks.errors import BadRequest, InvalidRequest, NotFound
from exo_tasks.types import MAX_LIST_LIMIT, DoneEvent, JobEnding, JobRecord, JobStatus, utcnow

bp = Blueprint("jobs", __name__, url_prefix="/v1/jobs")
# A Redis stream id: milliseconds, then optionally a sequence number, each an unsigned 64-bit.
STREAM_ID = re.compile(r"([0-9]{1,20})(?:-([0-9]{1,20}))?")


def public(job: JobEnding) -> dict[str, Any]:
    return job.model_dump(mode="json")


def summary(job: JobRecord) -> dict[str, Any]:
    return JobSummary.of(job).model_dump(mode="json")


@bp.post("")
def create_job() -> tuple[Response, int]:
    context = ctx()
    job_request = jobs.parse_request(context.settings, json_body())
    where = context.admit(job_request)
    job = context.submit(job_request, where=where, client=auth.client(job_request.user))
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
    listed = ctx().store.jobs.recent(status=status, limit=limit, before=before)
    if listed is None:
        raise NotFound(f"no job '{before}' among the recent ones", {"field": "before"})
    response = jsonify([summary(job) for job in with_progress(listed)])
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
    return jsonify(public(with_progress([get_or_404(job_id)])[0]))


def with_progress(listed: list[JobRecord]) -> list[JobRecord]:
    """The jobs, each running one with its tokens, text and timings so far (read from the
    event streams of the running ones, in one round trip)."""
    running = [job.id for job in listed if job.status == JobStatus.RUNNING]
    if not running:
        return listed
    histories = ctx().store.streams.event_histories(running)
    now = utcnow()
    return [progress.with_progress(job, histories.get(job.id, []), now) for job in listed]


@bp.get("/<job_id>/stream")
def stream_job(job_id: str) -> Response:
    """Tokens as `event: token`, then `event: done` (or `error`) with the job. Each event's
    `id:` is its stream position, so `Last-Event-ID` resumes without loss or repetition."""
    context = ctx()
    read, last = context.store.jobs.with_last_event(job_id)  # one round trip
    job = jobs.found_or_404(read, job_id)
    after = _resume_after()
    release = context.streams.acquire()
    overflow = streams.close_connection(request.environ)

    def events() -> Iterator[str]:
        yield KEEPALIVE  # the first byte at once, whatever the job is doing
        try:
            for item in streams.follow_from(context.hub, job_id, last, after, overflow):
                if item is None:
                    yield KEEPALIVE
                    continue
                event_id, event = item
                data = (
                    public(context.store.jobs.final(job, event))
                    if isinstance(event, DoneEvent)
                    else event.model_dump(exclude={"event"})
                )
                yield sse_event(event_id, event.event, data)
        except streams.StreamOverflow as exc:
            yield sse_event("", "error", {"type": "stream_overflow", "message": str(exc)})
        except (redis.ConnectionError, redis.TimeoutError):  # at its last read (a failover)
            message = "the broker (Redis) is unreachable; resume soon with Last-Event-ID"
            yield sse_event("", "error", {"type": "unavailable", "message": message})

    return sse_response(events(), on_close=release)


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


@bp.post("/<job_id>/cancel")
def cancel(job_id: str) -> tuple[Response, int]:
    """202 with the job: `cancelled` if it was queued, else still `running` until its runner's
    next step ends it."""
    context = ctx()
    job = jobs.cancel(context.store, job_id, jobs.CancelledBy.API, celery=context.celery)
    return jsonify(public(job)), 202
