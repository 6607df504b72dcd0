"""Hosts: the live workers, and stopping one (warm or cold) through Celery remote control."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from exo_tasks.api.context import ctx
from exo_tasks.api.jobs import json_body
from exo_tasks.errors import NotFound
from exo_tasks.types import HostShutdownBody

bp = Blueprint("hosts", __name__, url_prefix="/v1/hosts")
REPLY_TIMEOUT_S = 3.0


@bp.post("/<host>/shutdown")
def shutdown_host(host: str) -> tuple[Response, int]:
    """Warm: the worker stops taking jobs and lets in-flight ones finish within its window;
    cold: in-flight jobs go back to the queue now. The same paths as SIGTERM and SIGQUIT."""
    body = HostShutdownBody.model_validate(json_body(allow_empty=True))
    node = f"exo@{host}"
    replies = ctx().celery.control.broadcast(
        "exo_shutdown",
        arguments={"mode": body.mode},
        destination=[node],
        reply=True,
        limit=1,  # return as soon as the worker answers
        timeout=REPLY_TIMEOUT_S,
    )
    if not replies:
        raise NotFound(f"no live worker for host '{host}'", {"host": host})
    return jsonify({"host": host, "mode": body.mode, "reply": replies[0].get(node)}), 202
