"""Caps on what one request may ask for: each refusal names its limit and its setting."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.api import Api, api_settings, serving
from tests.support.stack import Stack


@pytest.fixture
def capped(stack: Stack, tiny_model: Path) -> Iterator[Api]:
    with serving(
        api_settings(stack.redis.url, [tiny_model], max_prompt_chars=50, max_body_bytes=2000)
    ) as api:
        yield api


def test_a_prompt_over_the_cap_is_422_naming_the_limit(capped: Api) -> None:
    for body, field in (
        ({"prompt": "p" * 51}, "prompt"),
        ({"messages": [{"role": "user", "content": "m" * 30}] * 2}, "messages"),
    ):
        response = capped.post("/v1/jobs", json=body)
        assert response.status_code == 422
        error = response.json()["error"]
        assert [d["field"] for d in error["details"]] == [field]
        assert "at most 50 (EXO_MAX_PROMPT_CHARS)" in error["message"]
    assert capped.post("/v1/jobs", json={"prompt": "p" * 50, "max_tokens": 1}).status_code == 202


def test_a_body_over_the_cap_is_413_naming_the_limit(capped: Api) -> None:
    response = capped.post("/v1/jobs", json={"prompt": "p" * 3000})
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["type"] == "request_entity_too_large"
    assert "2000 bytes (EXO_MAX_BODY_BYTES)" in error["message"]
    assert error["details"] == {"limit_bytes": 2000}


def test_max_tokens_over_the_cap_is_422_naming_the_limit(capped: Api) -> None:
    response = capped.post("/v1/jobs", json={"prompt": "p", "max_tokens": 4097})
    assert response.status_code == 422
    assert "at most 4096 (EXO_MAX_TOKENS)" in response.json()["error"]["message"]


@pytest.mark.parametrize("timeout_s", ["3566", "1e999", "Infinity", "NaN"])
def test_a_timeout_that_could_outlive_the_broker_is_422_naming_the_cap(
    capped: Api, timeout_s: str
) -> None:
    # Defaults: visibility 3600 s - hard grace 30 s - 5 s margin = 3565 s. A job that may run
    # longer would have its message delivered again while it still runs; an infinite one could
    # never end (its deadline was stored as null and the runner dropped it).
    body = '{"prompt": "p", "max_tokens": 1, "timeout_s": ' + timeout_s + "}"
    response = capped.post("/v1/jobs", data=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert [d["field"] for d in error["details"]] == ["timeout_s"]
    assert "timeout_s" in error["message"]
    chat = capped.post(
        "/v1/chat/completions",
        data='{"messages": [{"role": "user", "content": "p"}], "timeout_s": ' + timeout_s + "}",
        headers={"Content-Type": "application/json"},
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "timeout_s"


def test_the_longest_allowed_timeout_is_accepted(capped: Api) -> None:
    job_id = capped.submit(prompt="p", max_tokens=1, timeout_s=3565)
    assert capped.wait_job(job_id)["status"] == "succeeded"
