"""Bad input gets a clear 4xx in the JSON error shape, naming the field; nothing is enqueued."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient
from pydantic import ValidationError

from exo_tasks.api import create_app
from exo_tasks.api.models import SUMMARY_TEXT_CHARS, JobOptions, JobSummary
from exo_tasks.types import JobRecord, JobRequest
from tests.support.api import api_settings, serving
from tests.support.processes import free_port
from tests.support.stack import Stack

BAD_BODIES: list[tuple[dict[str, Any], str]] = [
    ({}, ""),  # neither prompt nor messages
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, ""),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 4097}, "max_tokens"),
    ({"prompt": "a", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "a", "temperature": 2.5}, "temperature"),
    ({"prompt": "a", "temperature": -0.1}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "stop": ["1", "2", "3", "4", "5"]}, "stop"),
    ({"prompt": "a", "stop": [""]}, "stop.0"),
    ({"prompt": "a", "seed": -1}, "seed"),
    ({"prompt": "a", "priority": "urgent"}, "priority"),
    ({"prompt": "a", "host": ""}, "host"),
    ({"prompt": "a", "timeout_s": 0}, "timeout_s"),
    ({"prompt": "a", "n": 2}, "n"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
]


@pytest.fixture(scope="module")
def offline() -> FlaskClient:
    """The app in process (Flask's test client) on a Redis nobody listens on: a request that
    reached Redis would be 503, so a 422 here was refused before anything was stored."""
    settings = api_settings(f"redis://127.0.0.1:{free_port()}/0", [Path("tiny")])
    return create_app(settings).test_client()


@pytest.mark.parametrize(("body", "field"), BAD_BODIES)
def test_bad_job_bodies_are_422_naming_the_field(
    offline: FlaskClient, body: dict[str, Any], field: str
) -> None:
    response = offline.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    assert response.json is not None
    error = response.json["error"]
    assert error["type"] == "invalid_request"
    if field:
        assert field in [d["field"] for d in error["details"]]
        assert field in error["message"]
    else:
        assert "exactly one of 'prompt' or 'messages'" in error["message"]


def test_a_body_that_cannot_be_read_is_400_and_one_not_an_object_422(stack: Stack) -> None:
    """As the README says: input that cannot be parsed is 400 (it was 422), a wrong type 422."""
    json_type = {"Content-Type": "application/json"}
    unreadable = [
        ("not json", json_type, "not valid JSON"),
        ("", json_type, "not valid JSON"),
        (b'{"prompt": "\xff"}', json_type, "not valid JSON"),  # not UTF-8
        ('{"prompt": "a"}', {"Content-Type": "text/plain"}, "Content-Type: application/json"),
        ('{"prompt": "a"}', {}, "Content-Type: application/json"),
    ]
    for data, headers, said in unreadable:
        response = stack.api.post("/v1/jobs", data=data, headers=headers)
        assert response.status_code == 400, (data, response.text)
        assert said in response.json()["error"]["message"]
    response = stack.api.post("/v1/jobs", data="[1, 2]", headers=json_type)
    assert response.status_code == 422
    assert "JSON object" in response.json()["error"]["message"]


def test_the_default_models_404_names_it_by_its_slug_not_its_path(
    stack: Stack, tmp_path: Path
) -> None:
    """A request that names no model gets the API's default one: its 404 showed the server's
    path to it."""
    private = tmp_path / "private-dir" / "house-model"
    with serving(api_settings(stack.redis.url, [private])) as api:
        response = api.post("/v1/jobs", json={"prompt": "a"})
    assert response.status_code == 404
    message = response.json()["error"]["message"]
    assert "the default model 'house-model' is not served" in message
    assert "private-dir" not in response.text


def test_an_unknown_model_is_404_naming_the_served_models(stack: Stack) -> None:
    response = stack.api.post("/v1/jobs", json={"prompt": "a", "model": "gpt-9"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert "gpt-9" in error["message"] and "tiny" in error["message"]
    assert error["details"]["field"] == "model" and "tiny" in error["details"]["served_models"]


def test_a_model_can_be_named_by_its_path(stack: Stack, tiny_model: object) -> None:
    job = stack.api.wait_job(stack.api.submit(prompt="a", max_tokens=2, model=str(tiny_model)))
    assert job["model"] == "tiny" and job["status"] == "succeeded"


def test_wrong_method_and_bad_query_are_json_errors(stack: Stack) -> None:
    assert stack.api.http.delete(stack.api.url + "/v1/jobs").json()["error"]["type"] == (
        "method_not_allowed"
    )
    response = stack.api.get("/v1/jobs", params={"status": "sleeping"})
    assert response.status_code == 422 and response.json()["error"]["details"]["field"] == "status"


def test_an_oversized_body_is_413(stack: Stack) -> None:
    response = stack.api.post("/v1/jobs", json={"prompt": "a" * (2 << 20)})
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "request_entity_too_large"


def test_max_tokens_cap_comes_from_the_context() -> None:
    JobRequest.model_validate({"prompt": "a", "max_tokens": 9000})
    with pytest.raises(ValidationError, match="at most 100"):
        JobRequest.model_validate(
            {"prompt": "a", "max_tokens": 101}, context={"max_tokens_cap": 100}
        )


def test_pinning_to_a_host_that_does_not_serve_the_model_is_404(stack: Stack) -> None:
    response = stack.api.post("/v1/jobs", json={"prompt": "a", "host": "elsewhere"})
    assert response.status_code == 404
    assert response.json()["error"]["details"]["field"] == "host"
    assert "elsewhere" in response.json()["error"]["message"]


def test_a_summary_keeps_every_request_field_but_the_prompt() -> None:
    """JobOptions restates JobRequest's fields for summaries: a field added to one only would
    go missing from the job list."""
    assert set(JobOptions.model_fields) == set(JobRequest.model_fields) - {"prompt", "messages"}
    job = JobRecord(id="j", model="tiny", request=JobRequest(prompt="p" * 1000, stop=["x"]))
    job.output.text = "t" * 1000
    summary = JobSummary.of(job).model_dump(mode="json")
    assert "prompt" not in summary["request"] and summary["request"]["stop"] == ["x"]
    assert summary["output"]["text"] == "t" * SUMMARY_TEXT_CHARS
    assert JobRecord.model_validate(job.model_dump()) == job  # the record itself is whole
