"""exo_tasks.errors.render: what any exception answers, the same through the Flask error funnel
and in a batch's result line (which is rendered in the worker, without Flask)."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from flask import Flask
from kombu.exceptions import OperationalError
from pydantic import BaseModel, ConfigDict, ValidationError
from redis.sentinel import MasterNotFoundError

from config.settings import Settings
from exo_tasks.api import errors as funnel
from exo_tasks.celery_app import INFERENCE_TASK, ExoCelery
from exo_tasks.errors import (
    ExoError,
    NotFound,
    QueueFull,
    Unauthorized,
    render,
)
from exo_tasks.store import redis_waits
from tests.support.processes import free_port


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_tokens: int


def invalid(body: dict[str, Any]) -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        Body.model_validate(body)
    return caught.value


CASES: list[Exception] = [
    invalid({"max_tokens": "many"}),
    invalid({"max_tokens": 1, "best_of": 2}),
    NotFound("model 'x' is not served", {"field": "model"}),
    QueueFull("the queue is full", retry_after_s=5),
    Unauthorized("a token is needed"),
    ExoError("internal"),
    redis.ConnectionError("refused"),
    redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'."),
    RuntimeError("a bug"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/jobs"])
@pytest.mark.parametrize("exc", CASES, ids=lambda e: type(e).__name__)
def test_the_funnel_answers_what_render_says(path: str, exc: Exception) -> None:
    status, body, headers = render(exc, openai=path.startswith("/v1/chat"))
    with Flask(__name__).test_request_context(path, method="POST"):
        response = funnel.handle(exc)
    assert (response.status_code, response.get_json()) == (status, body)
    assert {k: response.headers[k] for k in headers} == headers


def test_openai_shape_names_the_field_and_answers_400_for_invalid_input() -> None:
    status, body, _ = render(invalid({"max_tokens": "many"}), openai=True)
    assert status == 400
    assert body["error"]["param"] == "max_tokens"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "invalid_value"
    status, body, _ = render(invalid({"max_tokens": 1, "best_of": 2}), openai=True)
    assert body["error"]["code"] == "unsupported_parameter"


def test_project_shape_keeps_422_and_the_details() -> None:
    status, body, _ = render(invalid({"max_tokens": "many"}), openai=False)
    assert status == 422
    assert body["error"]["type"] == "invalid_request"
    assert body["error"]["details"][0]["field"] == "max_tokens"


def test_an_unserved_model_is_model_not_found_in_openai_shape() -> None:
    status, body, _ = render(NotFound("no such model", {"field": "model"}), openai=True)
    assert (status, body["error"]["code"]) == (404, "model_not_found")


def test_refusals_for_now_say_when_to_come_back() -> None:
    status, _, headers = render(QueueFull("full", retry_after_s=7), openai=False)
    assert (status, headers) == (429, {"Retry-After": "7"})


def test_redis_full_or_gone_is_503_and_anything_else_500() -> None:
    oom = redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'.")
    assert render(oom, openai=False)[1]["error"]["type"] == "storage_full"
    assert render(oom, openai=False)[0] == 503
    assert render(redis.TimeoutError("slow"), openai=False)[0] == 503
    status, body, _ = render(RuntimeError("secret detail"), openai=True)
    assert status == 500 and "secret" not in body["error"]["message"]


def test_redis_gone_or_without_a_master_says_when_to_come_back() -> None:
    # A failover: no master yet, or a message kombu could not send (its own error, Redis's
    # as its cause). Each is a 503 with Retry-After, never a 500.
    unsent = OperationalError("Error 111 connecting")
    unsent.__cause__ = MasterNotFoundError("No master found for 'exo'")
    for error in (redis.ConnectionError("refused"), MasterNotFoundError("none"), unsent):
        status, body, headers = render(error, openai=False)
        assert (status, body["error"]["type"]) == (503, "unavailable")
        assert int(headers["Retry-After"]) > 0


def test_a_message_celery_could_not_send_for_redis_is_redis_away_to_the_loops_that_wait() -> None:
    """kombu re-raises Redis's connection error as its own: the batch feeder (and every loop
    that waits Redis out) must take that for Redis away, not fail the batch whose line it sent.
    A real send, to a port nobody listens on."""
    settings = Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0", _env_file=None)
    with pytest.raises(OperationalError) as unsent:
        ExoCelery(settings, role="test").send_task(INFERENCE_TASK, args=["j", "m"], queue="q")
    assert redis_waits(unsent.value)
    assert not redis_waits(OperationalError("a kombu error of its own"))
