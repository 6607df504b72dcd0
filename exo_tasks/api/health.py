"""Liveness and readiness, open even when an API token is set."""

from __future__ import annotations

import redis
from flask import Blueprint, Response, jsonify

from exo_tasks.api.context import ctx
from exo_tasks.api.models import HealthReply, ReadinessReply

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz() -> Response:
    return jsonify(HealthReply().model_dump())


@bp.get("/readyz")
def readyz() -> tuple[Response, int]:
    """200 only when Redis answers and at least one runner of a live host takes jobs (or has
    unloaded its idle model, which the next job loads again), or an instance is Ready on live
    hosts (its ranks' runners count only through it)."""
    try:
        fleet = ctx().reads.fleet()
    except (redis.ConnectionError, redis.TimeoutError):
        down = ReadinessReply(status="unavailable", redis=False, ready_runners=[])
        return jsonify(down.model_dump()), 503
    ready = [r.id for r in fleet.whole_runners() if r.status.serves]
    instances = [i.id for i in fleet.ready_instances()]
    body = ReadinessReply(
        status="ready" if ready or instances else "no runner ready",
        redis=True,
        ready_runners=ready,
        ready_instances=instances,
    )
    return jsonify(body.model_dump()), 200 if ready or instances else 503
