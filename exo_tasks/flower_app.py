"""The Celery app as Flower loads it (`celery -A exo_tasks.flower_app flower`), with Flower's
`/metrics` behind Flower's own auth.

Flower 2.2.0 checks basic auth only in handlers marked `@authenticated`; its Prometheus
`/metrics` is not, so it answers anyone who can connect, whatever `--basic-auth` says.
"""

from __future__ import annotations

from typing import Any

import tornado.web
from flower.views.monitor import Metrics

from exo_tasks.worker.app import app

__all__ = ["app"]


def _authenticated(handler: Any) -> None:
    # `current_user` runs Flower's own check: HTTPError(401) for wrong basic-auth credentials,
    # None without an OAuth login, True when no auth is configured at all.
    if not handler.current_user:
        raise tornado.web.HTTPError(401)


Metrics.prepare = _authenticated
