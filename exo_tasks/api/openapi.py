"""GET /openapi.json: OpenAPI 3.1, generated from the pydantic models of every request and
response body and a compact table of the routes."""

from __future__ import annotations

import copy
import re
from functools import cache
from typing import Any, Literal

from flask import Blueprint, Response, jsonify
from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from config.settings import Settings
from exo_tasks.api.context import ctx
from exo_tasks.api.models import (
    HealthReply,
    HostInfo,
    HostShutdownBody,
    HostShutdownReply,
    JobSummary,
    ReadinessReply,
    RunnerDetail,
    RunnerLoadBody,
    RunnerLoadReply,
    RunnerShutdownBody,
    RunnerShutdownReply,
)
from exo_tasks.api.openapi_batches import BATCH_ROUTES
from exo_tasks.api.openapi_ops import JSON, Op, Reply
from exo_tasks.fleet_types import RunnerState
from exo_tasks.instances import InstanceRecord, InstanceRequest, InstanceShutdownBody
from exo_tasks.openai_types import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from exo_tasks.types import JobRecord, JobRequest, JobStatus

bp = Blueprint("openapi", __name__)
SSE = "text/event-stream"
PROMETHEUS = "text/plain"
# A body model and how it is used (read from a request, or written to a response) → its $ref.
Refs = dict[tuple[Any, JsonSchemaMode], dict[str, Any]]


class ErrorDetail(BaseModel):
    type: str
    message: str
    details: Any = None


class ErrorReply(BaseModel):
    """The error shape of every route but the OpenAI-compatible ones (errors.error_response)."""

    error: ErrorDetail


class OpenAIErrorDetail(BaseModel):
    message: str
    type: Literal["invalid_request_error", "server_error"]
    param: str | None = None
    code: str | None = None


class OpenAIErrorReply(BaseModel):
    """The error shape of the OpenAI-compatible routes, as OpenAI's clients read it."""

    error: OpenAIErrorDetail


def _command(
    path: str,
    summary: str,
    body: type[BaseModel],
    reply: type[BaseModel],
    errors: tuple[int, ...],
    *,
    body_required: bool = True,
) -> Op:
    """A POST that starts something on a host: a JSON body, 202 with `reply`."""
    return Op(
        "post",
        path,
        summary,
        {202: Reply(reply)},
        body=body,
        body_required=body_required,
        errors=(*errors, 400, 413, 422),
    )


def _completion(path: str, what: str, body: type[BaseModel], reply: type[BaseModel]) -> Op:
    return Op(
        "post",
        path,
        f"OpenAI-compatible {what}; with `stream`, server-sent events",
        {200: Reply(reply, or_events=True)},
        body=body,
        errors=(400, 404, 413, 429, 503),
        openai=True,
    )


_status = TypeAdapter(JobStatus).json_schema()
ROUTES: tuple[Op, ...] = (
    Op("get", "/healthz", "The API process is up", {200: Reply(HealthReply)}, public=True),
    Op(
        "get",
        "/readyz",
        "Redis answers and a runner is Ready",
        {200: Reply(ReadinessReply), 503: Reply(ReadinessReply, description="Not ready")},
        public=True,
    ),
    Op("get", "/metrics", "Prometheus metrics", {200: Reply(media=PROMETHEUS)}),
    Op("get", "/openapi.json", "This document", {200: Reply()}),
    Op(
        "post",
        "/v1/jobs",
        "Enqueue a job",
        {202: Reply(JobSummary, description="Queued")},
        body=JobRequest,
        errors=(400, 404, 413, 422, 429, 503),
    ),
    Op(
        "get",
        "/v1/jobs",
        "Recent jobs, newest first; a full page links to the next (Link, rel=next)",
        {200: Reply(JobSummary, many=True)},
        errors=(400, 404, 422),
        query={
            "status": _status,
            "limit": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 50},
            "before": {"type": "string", "description": "The last job id of the previous page"},
        },
    ),
    Op("get", "/v1/jobs/{job_id}", "A job", {200: Reply(JobRecord)}, errors=(404,)),
    Op(
        "get",
        "/v1/jobs/{job_id}/stream",
        "A job's tokens as server-sent events; Last-Event-ID resumes",
        {200: Reply(media=SSE, description="event: token … then event: done (or error)")},
        errors=(400, 404),
        query={"last_event_id": {"type": "string", "pattern": "^[0-9]{1,20}(-[0-9]{1,20})?$"}},
    ),
    Op(
        "post",
        "/v1/jobs/{job_id}/cancel",
        "Cancel a job",
        {202: Reply(JobRecord, description="Cancelled, or ending at its runner's next step")},
        errors=(404, 409),
    ),
    Op("get", "/v1/runners", "Every runner", {200: Reply(RunnerState, many=True)}),
    _command("/v1/runners", "Load a stopped runner", RunnerLoadBody, RunnerLoadReply, (404, 409)),
    Op("get", "/v1/runners/{runner_id}", "A runner", {200: Reply(RunnerDetail)}, errors=(404,)),
    _command(
        "/v1/runners/{runner_id}/shutdown",
        "Stop a runner (warm or hard)",
        RunnerShutdownBody,
        RunnerShutdownReply,
        (404, 409),
        body_required=False,
    ),
    Op("get", "/v1/hosts", "Live workers", {200: Reply(HostInfo, many=True)}),
    _command(
        "/v1/hosts/{host}/shutdown",
        "Stop a worker (warm or cold)",
        HostShutdownBody,
        HostShutdownReply,
        (404,),
        body_required=False,
    ),
    _command(
        "/v1/instances",
        "Place a model across hosts (or find the live instance of that placement)",
        InstanceRequest,
        InstanceRecord,
        (404,),
    ),
    Op("get", "/v1/instances", "Every instance", {200: Reply(InstanceRecord, many=True)}),
    Op(
        "get",
        "/v1/instances/{instance_id}",
        "An instance: its status and each rank's",
        {200: Reply(InstanceRecord)},
        errors=(404,),
    ),
    _command(
        "/v1/instances/{instance_id}/shutdown",
        "Stop an instance (warm: drained first; hard: now)",
        InstanceShutdownBody,
        InstanceRecord,
        (404, 409),
        body_required=False,
    ),
    _completion("/v1/chat/completions", "chat completion", ChatCompletionRequest, ChatCompletion),
    _completion("/v1/completions", "completion", CompletionRequest, Completion),
    Op("get", "/v1/models", "Served models", {200: Reply(ModelList)}, openai=True),
    Op(
        "get",
        "/v1/models/{model}",
        "A served model",
        {200: Reply(ModelCard)},
        errors=(404,),
        openai=True,
    ),
    *BATCH_ROUTES,
)


def _schemas() -> tuple[Refs, dict[str, Any]]:
    """A $ref for every body model, and the shared component schemas they point to."""
    keys: dict[tuple[type[BaseModel], JsonSchemaMode], None] = {
        (ErrorReply, "serialization"): None,
        (OpenAIErrorReply, "serialization"): None,
    }
    for op in ROUTES:
        if op.body is not None:
            keys[(op.body, "validation")] = None
        keys.update({(r.model, "serialization"): None for r in op.replies.values() if r.model})
    refs, defs = models_json_schema(list(keys), ref_template="#/components/schemas/{model}")
    return refs, defs.get("$defs", {})


def _content(reply: Reply, ref: dict[str, Any] | None) -> dict[str, Any]:
    schema: dict[str, Any] = ref or {"type": "object" if reply.media == JSON else "string"}
    if reply.many:
        schema = {"type": "array", "items": schema}
    content = {reply.media: {"schema": schema}}
    if reply.or_events:
        content[SSE] = {"schema": {"type": "string"}}
    return content


def _operation(op: Op, refs: Refs) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "operationId": op.method + "_" + re.sub(r"[^a-zA-Z0-9]+", "_", op.path).strip("_"),
        "summary": op.summary,
        "responses": _responses(op, refs),
    }
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in _path_params(op.path)
    ] + [{"name": name, "in": "query", "schema": schema} for name, schema in op.query.items()]
    if parameters:
        operation["parameters"] = parameters
    if op.body is not None:
        operation["requestBody"] = {
            "required": op.body_required,
            "content": {op.body_media: {"schema": refs[(op.body, "validation")]}},
        }
    if op.public:
        operation["security"] = []
    return operation


def _responses(op: Op, refs: Refs) -> dict[str, Any]:
    """Its replies, then each error status it may answer (in the route's error shape)."""
    responses: dict[str, Any] = {}
    for status, reply in op.replies.items():
        ref = refs[(reply.model, "serialization")] if reply.model else None
        responses[str(status)] = {"description": reply.description, "content": _content(reply, ref)}
    error_ref = refs[(OpenAIErrorReply if op.openai else ErrorReply, "serialization")]
    error = {"description": "An error", "content": _content(Reply(), error_ref)}
    codes = (*op.errors, *(() if op.public else (401, 503)))
    for status in sorted(set(codes) - set(op.replies)):
        responses[str(status)] = error
    responses["default"] = error
    return responses


def _path_params(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{")]


@cache
def _paths() -> tuple[dict[str, Any], dict[str, Any]]:
    refs, components = _schemas()
    paths: dict[str, Any] = {}
    for op in ROUTES:
        paths.setdefault(op.path, {})[op.method] = _operation(op, refs)
    return paths, components


# Caps that are configuration: pydantic applies them at validation (as context), so the schemas
# get them here. Property → (JSON Schema keyword, the type it bounds, the setting).
CAPS = {
    "max_tokens": ("maximum", "integer", "max_tokens"),
    "max_completion_tokens": ("maximum", "integer", "max_tokens"),
    "prompt": ("maxLength", "string", "max_prompt_chars"),
    # Each message costs a token at least (exo_tasks.types.MIN_TOKENS_PER_MESSAGE).
    "messages": ("maxItems", "array", "max_prompt_tokens"),
}


def _with_caps(components: dict[str, Any], settings: Settings) -> dict[str, Any]:
    capped = copy.deepcopy(components)
    for schema in capped.values():
        for name, (keyword, type_, setting) in CAPS.items():
            prop = schema.get("properties", {}).get(name)
            for option in prop.get("anyOf", [prop]) if prop else []:
                if option.get("type") == type_:
                    option[keyword] = getattr(settings, setting)
    return capped


def build_spec(settings: Settings) -> dict[str, Any]:
    paths, components = _paths()
    spec: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "exo_tasks",
            "version": "1",
            "description": "A job queue for LLM inference on a fleet of MLX hosts.",
        },
        "paths": paths,
        "components": {"schemas": _with_caps(components, settings)},
    }
    if settings.api_token is not None:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        spec["security"] = [{"bearer": []}]
    return spec


@bp.get("/openapi.json")
def openapi_json() -> Response:
    return jsonify(build_spec(ctx().settings))
