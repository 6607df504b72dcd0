"""Bearer-token auth: with EXO_API_TOKEN set, every route but the health checks needs it."""

from __future__ import annotations

import hmac

from flask import Flask, request

from exo_tasks.api.context import ctx
from exo_tasks.errors import Unauthorized

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
SCHEME = "Bearer "


def require_token() -> None:
    token = ctx().settings.api_token
    if token is None or request.path in OPEN_PATHS:
        return
    given = request.headers.get("Authorization", "")
    # Constant time: how much of a guess matched must not show in the response time.
    if not given.startswith(SCHEME) or not hmac.compare_digest(
        given.removeprefix(SCHEME).encode(), token.get_secret_value().encode()
    ):
        raise Unauthorized("a valid 'Authorization: Bearer <token>' header is required")


def init_app(app: Flask) -> None:
    app.before_request(require_token)
