"""Runners: what each host's runners are doing, and stopping or starting one."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from config.celery import PRIORITY_LEVELS
from exo_tasks.api.context import ctx
from exo_tasks.api.http import json_body
from exo_tasks.api.models import (
    RunnerDetail,
    RunnerLoadBody,
    RunnerLoadReply,
    RunnerShutdownBody,
    RunnerShutdownReply,
)
from exo_tasks.celery_app import LOAD_RUNNER_TASK, SHUTDOWN_RUNNER_TASK
from exo_tasks.errors import Conflict, NotFound
from exo_tasks.fleet_types import RunnerState
from exo_tasks.naming import find_model, host_queue, runner_id_for

bp = Blueprint("runners", __name__, url_prefix="/v1/runners")


def get_or_404(runner_id: str) -> RunnerState:
    state = ctx().store.runners.get(runner_id)
    if state is None:
        raise NotFound(f"no runner '{runner_id}'", {"runner_id": runner_id})
    return state


@bp.get("")
def list_runners() -> Response:
    return jsonify([r.model_dump(mode="json") for r in ctx().store.runners.all()])


@bp.get("/<runner_id>")
def get_runner(runner_id: str) -> Response:
    state = get_or_404(runner_id)
    detail = RunnerDetail(**dict(state), history=ctx().store.runners.history(runner_id))
    return jsonify(detail.model_dump(mode="json"))


@bp.post("/<runner_id>/shutdown")
def shutdown_runner(runner_id: str) -> tuple[Response, int]:
    """Send `shutdown_runner` to the runner's host queue; its supervisor stops the runner."""
    context = ctx()
    body = RunnerShutdownBody.model_validate(json_body(allow_empty=True))
    state = get_or_404(runner_id)
    if state.is_down:
        raise Conflict(f"runner '{runner_id}' is already {state.status}", {"status": state.status})
    timeout_s = body.timeout_s
    if timeout_s is None:
        timeout_s = context.settings.runner_shutdown_grace_s if body.mode == "warm" else 0.0
    # A live runner is named by its pid: if it is restarted before the task runs, the new one
    # is not stopped. A failed runner waiting for its restart is stopped whatever its pid.
    pid = None if state.status.is_final else state.pid
    task = context.celery.send_task(
        SHUTDOWN_RUNNER_TASK,
        args=[runner_id, body.mode, timeout_s, pid],
        queue=host_queue(state.host),
        priority=PRIORITY_LEVELS["high"],
        expires=context.settings.control_expires_s,
    )
    reply = RunnerShutdownReply(
        runner_id=runner_id, task_id=task.id, mode=body.mode, timeout_s=timeout_s
    )
    return jsonify(reply.model_dump(mode="json")), 202


@bp.post("")
def load_runner() -> tuple[Response, int]:
    """Send `load_runner` to a host that serves the model and has its runner stopped."""
    context = ctx()
    body = RunnerLoadBody.model_validate(json_body())
    fleet = context.reads.fleet()
    if body.host is not None and body.host not in fleet.hosts:
        raise NotFound(f"host '{body.host}' has no live worker", {"field": "host"})
    state = _stopped_runner(fleet.live_runners(), body)
    task = context.celery.send_task(
        LOAD_RUNNER_TASK,
        args=[state.id],
        queue=host_queue(state.host),
        priority=PRIORITY_LEVELS["high"],
        expires=context.settings.control_expires_s,
    )
    reply = RunnerLoadReply(runner_id=state.id, task_id=task.id, host=state.host)
    return jsonify(reply.model_dump(mode="json")), 202


def _stopped_runner(runners: list[RunnerState], body: RunnerLoadBody) -> RunnerState:
    """The runner to load for `body`: 404 when none serves the model (on that host), 409 when
    none of them is down or unloaded."""
    runners = [
        r
        for r in runners
        if find_model(body.model, [r.model])
        and (body.host is None or r.id == runner_id_for(r.model, body.host))
    ]
    if not runners:
        where = f" on host '{body.host}'" if body.host else ""
        raise NotFound(f"no runner for model '{body.model}'{where}", {"field": "model"})
    stopped = [r for r in runners if r.loadable]
    if not stopped:
        raise Conflict(
            f"runner '{runners[0].id}' is already {runners[0].status}",
            {"status": runners[0].status},
        )
    return stopped[0]
