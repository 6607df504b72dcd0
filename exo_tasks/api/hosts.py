"""Hosts: the live workers, and stopping one (warm or cold) through Celery remote control."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from exo_tasks.api.context import ctx
from exo_tasks.api.http import json_body
from exo_tasks.api.models import HostInfo, HostShutdownBody, HostShutdownReply
from exo_tasks.errors import NotFound
from exo_tasks.fleet import Fleet
from exo_tasks.naming import host_queue, instance_queue, model_queue, node_name

bp = Blueprint("hosts", __name__, url_prefix="/v1/hosts")
REPLY_TIMEOUT_S = 3.0


@bp.get("")
def list_hosts() -> Response:
    """The live workers (the heartbeats routing uses too), with their runners and queue depths."""
    store = ctx().store
    fleet = Fleet.load(store)
    hosts: list[HostInfo] = []
    for name, live in sorted(fleet.hosts.items()):
        placed = fleet.host_instances(name)
        queues = [host_queue(name)] + [model_queue(m) for m in live.models]
        # An instance's jobs wait in its own queue, which its rank-0 host consumes.
        queues += [instance_queue(i.id) for i in placed if i.rank0_host == name]
        hosts.append(
            HostInfo(
                name=name,
                node=node_name(name),
                pid=live.pid,
                concurrency=live.concurrency,
                models=live.models,
                runners=fleet.host_runners(name),
                instances=[i.id for i in placed],
                queues={q: store.jobs.queue_depth(q) for q in queues},
            )
        )
    return jsonify([h.model_dump(mode="json") for h in hosts])


@bp.post("/<host>/shutdown")
def shutdown_host(host: str) -> tuple[Response, int]:
    """Warm: the worker stops taking jobs and lets in-flight ones finish within its window;
    cold: in-flight jobs go back to the queue now. The same paths as SIGTERM and SIGQUIT."""
    body = HostShutdownBody.model_validate(json_body(allow_empty=True))
    # No heartbeat: do not wait for a reply. A host shutting down still answers (warm, then cold).
    if ctx().store.hosts.get(host) is None:
        raise NotFound(f"no live worker for host '{host}'", {"host": host})
    node = node_name(host)
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
    reply = HostShutdownReply(host=host, mode=body.mode, reply=replies[0].get(node))
    return jsonify(reply.model_dump(mode="json")), 202
