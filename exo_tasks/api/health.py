"""Liveness and readiness, open even when an API token is set."""

from __future__ import annotations

import redis
from flask import Blueprint, Response, jsonify

from exo_tasks.api.context import ctx

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz() -> Response:
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz() -> tuple[Response, int]:
    """200 only when Redis answers and at least one runner is Ready."""
    try:
        ready = [r.id for r in ctx().store.list_runners() if r.status.accepts_jobs]
    except (redis.ConnectionError, redis.TimeoutError):
        return jsonify({"status": "unavailable", "redis": False, "ready_runners": []}), 503
    status = 200 if ready else 503
    body = {
        "status": "ready" if ready else "no runner ready",
        "redis": True,
        "ready_runners": ready,
    }
    return jsonify(body), status
