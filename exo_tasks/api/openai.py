"""OpenAI-compatible routes: chat completions and completions (streamed or not), and models.

A request becomes an ordinary job (same validation, queue, runners and record as POST /v1/jobs)
and its answer is read from the job's event stream. A streaming client that goes away cancels
its job. Errors on these routes take OpenAI's shape (see exo_tasks.api.errors).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

from flask import Blueprint, Response, jsonify, request
from pydantic import BaseModel

from exo_tasks import jobs, limits
from exo_tasks.api import auth, errors, streams
from exo_tasks.api.arrivals import Passage
from exo_tasks.api.context import ApiContext, ctx
from exo_tasks.api.http import KEEPALIVE, json_body, sse_response
from exo_tasks.errors import ExoError, NotFound, Unavailable, openai_error_body, render
from exo_tasks.fairness import Client
from exo_tasks.fleet import is_down
from exo_tasks.naming import find_model, runner_id_for
from exo_tasks.openai_render import ChatRenderer, Renderer, Sent, TextRenderer, failure
from exo_tasks.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    OpenAIRequest,
    openai_finish_reason,
)
from exo_tasks.types import (
    DoneEvent,
    JobEnding,
    JobRecord,
    JobRequest,
    JobStatus,
    RequeuedEvent,
    TokenEvent,
)

bp = Blueprint("openai", __name__, url_prefix="/v1")
# A non-streaming request waits for its job's own time limits plus this, counted from submission.
WAIT_SLACK_S = 10.0
DONE = "data: [DONE]\n\n"


@bp.post("/chat/completions")
def chat_completions() -> Response:
    return _complete(ChatCompletionRequest, ChatRenderer())


@bp.post("/completions")
def completions() -> Response:
    return _complete(CompletionRequest, TextRenderer())


def _complete(kind: type[OpenAIRequest], renderer: Renderer) -> Response:
    context = ctx()
    # Arriving until its answer is ready: a stream's first byte is written as this returns.
    with context.arrivals.arriving() as arrival:
        body = kind.model_validate(
            json_body(), context={"max_tokens_cap": context.settings.max_tokens}
        )
        job_request = jobs.parse_request(context.settings, body.job_fields())
        where = context.admit(job_request)
        if body.stream:
            return _open_stream(context, renderer, job_request, where, body.include_usage, arrival)
    job = context.submit(job_request, where=where, client=auth.client(job_request.user))
    response = jsonify(renderer.whole(_wait(context, job)).model_dump(mode="json"))
    response.headers["X-Exo-Job-Id"] = job.id  # for GET /v1/jobs/<id>, its stream, or a cancel
    return response


def _open_stream(
    context: ApiContext,
    renderer: Renderer,
    job_request: JobRequest,
    where: jobs.Route,
    include_usage: bool,
    arrival: Passage,
) -> Response:
    """A streamed answer whose job is submitted after its first byte (see _stream), to
    `where`. Errors keep their statuses before the first byte, a full queue's or a client's
    full quota's 429 too (the job's creation counts again: these are reads)."""
    depth = context.reads.queue_depth(where.queue)
    jobs.refuse_if_full(where.queue, depth, context.settings)
    client = auth.client(job_request.user)
    jobs.refuse_over_quota(client, context.store.jobs.client_waiting(client.key), context.settings)
    release = context.streams.acquire()  # before the job exists: a 503 leaves nothing behind
    closed = context.arrivals.stream_opened()
    overflow = streams.close_connection(request.environ)
    plan = _Stream(context, renderer, overflow, include_usage, client)
    job_id = jobs.new_job_id()
    stream = _stream(plan, job_request, job_id, where, arrival)

    def on_close() -> None:
        closed()
        release()

    response = sse_response(stream, on_close=on_close)
    response.headers["X-Exo-Job-Id"] = job_id
    return response


def _wait(context: ApiContext, job: JobRecord) -> JobEnding:
    """The job once it has ended; a failed job is an error. Bounded by the job's time limits:
    past them (it sat in the queue) the job is cancelled and the request gets 503."""
    settings = context.settings
    limit_s = limits.job_limits(job.request.timeout_s, settings).hard_s + WAIT_SLACK_S
    deadline = time.monotonic() + limit_s
    final: JobEnding | None = None
    for item in streams.follow(context.hub, context.store, job.id):
        if item is not None and isinstance(item[1], DoneEvent):
            final = context.store.jobs.final(job, item[1])
        elif time.monotonic() > deadline:
            with contextlib.suppress(ExoError):
                jobs.cancel(
                    context.store, job.id, jobs.CancelledBy.WAIT_ENDED, celery=context.celery
                )
            raise Unavailable(
                f"job {job.id} did not finish within {limit_s:.0f}s; it was cancelled",
                {"job_id": job.id},
            )
    assert final is not None, "a job's event stream ends with its DoneEvent"
    if final.status == JobStatus.FAILED:
        raise failure(final)
    return final


def _data(body: BaseModel | dict[str, Any]) -> str:
    text = body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body)
    return f"data: {text}\n\n"


@dataclass
class _Stream:
    """How one streamed answer is written."""

    context: ApiContext
    renderer: Renderer
    overflow: Callable[[], None]  # ends the connection at once (the client fell behind)
    include_usage: bool
    client: Client


def _stream(
    plan: _Stream, job_request: JobRequest, job_id: str, where: jobs.Route, arrival: Passage
) -> Iterator[str]:
    """The first byte at once, then the job submitted (already routed), then its chunks.
    Thousands of clients arriving together each get their first byte within moments, and
    their jobs are submitted once the burst is in, a lone request's at once (arrivals.py,
    `arrival`: its request's way in); a submission refused after all (the queue filled
    meanwhile, Redis went down) ends the stream with the error, in OpenAI's shape."""
    yield KEEPALIVE
    try:
        job = plan.context.submit(job_request, job_id, where, client=plan.client, arrival=arrival)
    except Exception as exc:  # noqa: BLE001 (the error funnel decides, and logs the unexpected)
        yield _data(json.loads(errors.handle(exc).get_data()))
        yield DONE
        return
    yield from _job_stream(plan, job)


def _job_stream(plan: _Stream, job: JobRecord) -> Iterator[str]:
    """The job as OpenAI stream chunks, a keepalive comment each second nothing happens (a
    queued job, a long prompt), then `data: [DONE]`. If the client goes away, the next write
    fails, the server closes this generator, and the job is cancelled; so it is if the client
    falls EXO_STREAM_BUFFER_EVENTS events behind."""
    ended = False
    try:
        for opening in plan.renderer.opening(job):
            yield _data(opening)
        ended = yield from _chunks(plan, job)
    except streams.StreamOverflow as exc:
        yield _data(openai_error_body(503, str(exc), code="stream_overflow"))
    finally:
        if not ended:
            with contextlib.suppress(ExoError):
                context = plan.context
                jobs.cancel(
                    context.store, job.id, jobs.CancelledBy.CLIENT_GONE, celery=context.celery
                )


def _chunks(plan: _Stream, job: JobRecord) -> Generator[str, None, bool]:
    """The job's chunks, up to `data: [DONE]`; True if its job ended."""
    ended = False
    sent = Sent()
    renderer = plan.renderer
    follow = streams.follow(plan.context.hub, plan.context.store, job.id, on_overflow=plan.overflow)
    for item in follow:
        if item is None:
            yield KEEPALIVE
            continue
        event = item[1]
        if isinstance(event, TokenEvent):
            yield _data(renderer.chunk(job, event, None, sent))
            sent.add(event)
        elif isinstance(event, RequeuedEvent) and sent.chars + sent.calls:
            # The next attempt starts over, and text already sent cannot be taken back:
            # end this stream (and, above, the job nobody will read).
            message = f"job {job.id} was requeued after its worker stopped; retry"
            yield _data(openai_error_body(503, message, code="requeued"))
            break
        elif isinstance(event, DoneEvent):
            ended = True
            yield from _ending(renderer, job, event.job, plan.include_usage)
    yield DONE
    return ended


def _ending(
    renderer: Renderer, job: JobRecord, final: JobEnding, include_usage: bool
) -> Iterator[str]:
    if final.status == JobStatus.FAILED:
        _, body, _ = render(failure(final), openai=True)
        yield _data(body)
        return
    finish = openai_finish_reason(final.output.finish_reason, final.output.tool_calls)
    yield _data(renderer.chunk(job, None, finish, Sent()))
    if include_usage:
        yield _data(renderer.usage_chunk(final))


# --- models ---


@bp.get("/models")
def list_models() -> Response:
    return jsonify(ModelList(data=_served_models()).model_dump(mode="json"))


@bp.get("/models/<path:model>")
def get_model(model: str) -> Response:
    cards = {card.id: card for card in _served_models()}
    found = find_model(model, cards)
    if found is not None:
        return jsonify(cards[found].model_dump(mode="json"))
    served = ", ".join(cards) or "none"
    raise NotFound(f"model '{model}' is not served; served models: {served}", {"field": "model"})


def _served_models() -> list[ModelCard]:
    """Each model a live host serves with a runner that is up (or starting), and those hosts;
    or an instance that serves it (placed, starting or ready, on live hosts), and its hosts."""
    fleet = ctx().reads.fleet()
    cards: list[ModelCard] = []
    for model in fleet.models:
        hosts = [
            host
            for host in sorted(fleet.hosts.values(), key=lambda h: h.name)
            if model in host.models
            and not is_down(fleet.runners.get(runner_id_for(model, host.name)))
        ]
        instances = fleet.serving_instances(model)
        started = [int(h.started_at.timestamp()) for h in hosts]
        started += [int(i.created_at.timestamp()) for i in instances]
        if started:
            names = [h.name for h in hosts] + [h for i in instances for h in i.hosts]
            cards.append(
                ModelCard(
                    id=model,
                    created=min(started),
                    hosts=list(dict.fromkeys(names)),
                    instances=[i.id for i in instances],
                )
            )
    return cards
