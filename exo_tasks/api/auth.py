"""Bearer-token auth: with EXO_API_TOKEN set, every route but the health checks needs it. And
who a request's client is, for its quota and its place in the queue (exo_tasks.fairness)."""

from __future__ import annotations

import hmac

from flask import Flask, request

from exo_tasks import fairness
from exo_tasks.api.context import ctx
from exo_tasks.errors import Unauthorized

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
SCHEME = "bearer"


def require_token() -> None:
    token = ctx().settings.api_token
    if token is None or request.path in OPEN_PATHS:
        return
    # The scheme is case-insensitive (RFC 9110 §11.1): `bearer` and `BEARER` are Bearer.
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    # Constant time: how much of a guess matched must not show in the response time.
    if scheme.lower() != SCHEME or not hmac.compare_digest(
        credentials.lstrip(" ").encode(), token.get_secret_value().encode()
    ):
        raise Unauthorized("a valid 'Authorization: Bearer <token>' header is required")


def client(user: str | None) -> fairness.Client:
    """The client this request comes from: the job's `user`, else the API token (a request
    gets here only with the right one), else the peer's address."""
    token = ctx().settings.api_token
    secret = token.get_secret_value() if token is not None else None
    return fairness.client_of(user, secret, request.remote_addr)


def init_app(app: Flask) -> None:
    app.before_request(require_token)
