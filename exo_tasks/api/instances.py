"""Instances: one model placed across several hosts (exo_tasks.instances), listed, shown and
stopped. The blueprint parses and renders; exo_tasks.instance_service decides."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from exo_tasks import instance_service
from exo_tasks.api.context import ctx
from exo_tasks.api.http import json_body
from exo_tasks.fleet import Fleet
from exo_tasks.instances import InstanceRecord, InstanceRequest, InstanceShutdownBody

bp = Blueprint("instances", __name__, url_prefix="/v1/instances")


def _render(record: InstanceRecord, status: int = 200) -> tuple[Response, int]:
    return jsonify(record.model_dump(mode="json")), status


@bp.post("")
def place_instance() -> tuple[Response, int]:
    """202: placed (Pending), or the live instance of the same placement as it is."""
    context = ctx()
    request = InstanceRequest.model_validate(json_body())
    fleet = Fleet.load(context.store)
    return _render(instance_service.place(context.store, context.settings, fleet, request), 202)


@bp.get("")
def list_instances() -> Response:
    return jsonify([i.model_dump(mode="json") for i in ctx().store.instances.all()])


@bp.get("/<instance_id>")
def get_instance(instance_id: str) -> tuple[Response, int]:
    return _render(instance_service.get_or_404(ctx().store, instance_id))


@bp.post("/<instance_id>/shutdown")
def shutdown_instance(instance_id: str) -> tuple[Response, int]:
    """202: ShuttingDown with the mode, for its hosts' supervisors to act on (a Pending one,
    with no rank running yet, is Shutdown at once)."""
    body = InstanceShutdownBody.model_validate(json_body(allow_empty=True))
    return _render(instance_service.shutdown(ctx().store, instance_id, body.mode), 202)
