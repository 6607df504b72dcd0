"""With EXO_API_TOKEN set, every route but the health checks needs `Authorization: Bearer`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.api import Api, api_settings, serving
from tests.support.stack import Stack

TOKEN = "s3cret-token"
GOOD = {"Authorization": f"Bearer {TOKEN}"}
GUARDED = [
    ("get", "/v1/jobs"),
    ("post", "/v1/jobs"),
    ("get", "/v1/jobs/some-id"),
    ("post", "/v1/jobs/some-id/cancel"),
    ("get", "/v1/runners"),
    ("post", "/v1/runners/nobody@nowhere/shutdown"),
    ("get", "/v1/hosts"),
    ("post", "/v1/hosts/nowhere/shutdown"),
    ("get", "/v1/instances"),
    ("post", "/v1/instances"),
    ("get", "/v1/instances/inst-some-id"),
    ("post", "/v1/instances/inst-some-id/shutdown"),
    ("get", "/metrics"),
    ("get", "/openapi.json"),
    ("post", "/v1/chat/completions"),
    ("get", "/v1/models"),
    ("get", "/no/such/route"),
]
BAD_HEADERS = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Bearer {TOKEN}x"},
    {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": TOKEN},
]


@pytest.fixture
def guarded(stack: Stack, tiny_model: Path) -> Iterator[Api]:
    with serving(api_settings(stack.redis.url, [tiny_model], api_token=TOKEN)) as api:
        yield api


def test_health_checks_stay_open(guarded: Api) -> None:
    assert guarded.get("/healthz").status_code == 200
    assert guarded.get("/readyz").status_code == 200


@pytest.mark.parametrize(("method", "path"), GUARDED)
def test_every_other_route_is_401_without_the_right_token(
    stack: Stack, guarded: Api, method: str, path: str
) -> None:
    before = stack.store.redis.zcard("exo:jobs")
    for headers in BAD_HEADERS:
        response = getattr(guarded.http, method)(
            guarded.url + path, json={"prompt": "x"}, headers=headers, timeout=10
        )
        assert response.status_code == 401, (headers, response.text)
        assert response.headers["WWW-Authenticate"] == "Bearer"
        error = response.json()["error"]
        assert "Authorization: Bearer" in error["message"]
        if not path.startswith("/v1/chat") and path != "/v1/models":
            assert error["type"] == "unauthorized"
    assert stack.store.redis.zcard("exo:jobs") == before


def test_the_right_token_opens_the_api(guarded: Api) -> None:
    guarded.http.headers.update(GOOD)
    assert guarded.get("/v1/runners").status_code == 200
    assert guarded.get("/metrics").status_code == 200
    job = guarded.wait_job(guarded.submit(prompt="let me in", max_tokens=4))
    assert job["status"] == "succeeded"


def test_the_scheme_is_case_insensitive(guarded: Api) -> None:
    """RFC 9110 §11.1: `bearer` was refused."""
    for scheme in ("bearer", "BEARER", "Bearer ", "bEaReR"):
        headers = {"Authorization": f"{scheme} {TOKEN}"}
        assert guarded.get("/v1/runners", headers=headers).status_code == 200, scheme
