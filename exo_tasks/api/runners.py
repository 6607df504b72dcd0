"""Runner views: what each host's runners are doing and how they got there."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from exo_tasks.api.context import ctx
from exo_tasks.errors import NotFound

bp = Blueprint("runners", __name__, url_prefix="/v1/runners")


@bp.get("")
def list_runners() -> Response:
    return jsonify([r.model_dump(mode="json") for r in ctx().store.list_runners()])


@bp.get("/<runner_id>")
def get_runner(runner_id: str) -> Response:
    store = ctx().store
    state = store.get_runner(runner_id)
    if state is None:
        raise NotFound(f"no runner '{runner_id}'", {"runner_id": runner_id})
    history = [change.model_dump(mode="json") for change in store.runner_history(runner_id)]
    return jsonify({**state.model_dump(mode="json"), "history": history})
