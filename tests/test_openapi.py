"""GET /openapi.json: valid OpenAPI 3.1, every route documented, and real answers match it."""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import pytest
from openapi_spec_validator import validate

from exo_tasks.types import JobRequest
from tests.support.api import api_settings, serving
from tests.support.stack import Stack

METHODS = {"GET", "POST", "PUT", "PATCH", "DELETE"}


@pytest.fixture(scope="module")
def spec(stack: Stack) -> dict[str, Any]:
    response = stack.api.get("/openapi.json")
    assert response.status_code == 200
    document: dict[str, Any] = response.json()
    return document


def test_the_document_is_valid_openapi_3_1(spec: dict[str, Any]) -> None:
    assert spec["openapi"].startswith("3.1")
    validate(spec)  # raises on any problem
    operation_ids = [op["operationId"] for ops in spec["paths"].values() for op in ops.values()]
    assert len(operation_ids) == len(set(operation_ids))


def test_every_route_and_method_is_documented(stack: Stack, spec: dict[str, Any]) -> None:
    served = {
        (re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule), method.lower())
        for rule in stack.api.app.url_map.iter_rules()
        if rule.endpoint != "static"
        for method in (rule.methods or set()) & METHODS
    }
    documented = {(path, method) for path, ops in spec["paths"].items() for method in ops}
    assert documented == served


def test_request_bodies_are_the_pydantic_models(spec: dict[str, Any]) -> None:
    body = spec["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]
    schema = resolve(spec, body["schema"])
    assert set(schema["properties"]) == set(JobRequest.model_fields)
    assert schema["additionalProperties"] is False
    assert schema["properties"]["priority"]["enum"] == ["high", "normal", "low"]
    # The configured caps, which pydantic only knows at validation time.
    assert schema["properties"]["max_tokens"]["maximum"] == 4096
    assert {"type": "string", "minLength": 1, "maxLength": 100_000} in (
        schema["properties"]["prompt"]["anyOf"]
    )


def resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    name = schema["$ref"].rsplit("/", 1)[1]
    resolved: dict[str, Any] = spec["components"]["schemas"][name]
    return resolved


def check(spec: dict[str, Any], path: str, method: str, response: Any) -> None:
    """The answer's status is documented and its body matches the documented schema."""
    documented = spec["paths"][path][method]["responses"]
    entry = documented.get(str(response.status_code), documented["default"])
    schema = entry["content"]["application/json"]["schema"]
    document = {**schema, "components": spec["components"]}
    jsonschema.validate(response.json(), document)


def test_real_answers_match_the_document(stack: Stack, spec: dict[str, Any]) -> None:
    api = stack.api
    created = api.post("/v1/jobs", json={"prompt": "doc", "max_tokens": 3})
    check(spec, "/v1/jobs", "post", created)
    job_id = created.json()["id"]
    api.wait_job(job_id)
    check(spec, "/v1/jobs/{job_id}", "get", api.get(f"/v1/jobs/{job_id}"))
    check(spec, "/v1/jobs", "get", api.get("/v1/jobs"))
    check(spec, "/v1/jobs/{job_id}/cancel", "post", api.post(f"/v1/jobs/{job_id}/cancel"))
    check(spec, "/v1/runners", "get", api.get("/v1/runners"))
    check(spec, "/v1/runners/{runner_id}", "get", api.get("/v1/runners/tiny@host-a"))
    check(spec, "/v1/hosts", "get", api.get("/v1/hosts"))
    check(spec, "/readyz", "get", api.get("/readyz"))
    check(spec, "/v1/jobs", "post", api.post("/v1/jobs", json={"prompt": ""}))
    check(spec, "/v1/jobs/{job_id}", "get", api.get("/v1/jobs/nope"))
    check(spec, "/v1/models", "get", api.get("/v1/models"))
    check(spec, "/v1/instances", "get", api.get("/v1/instances"))
    check(spec, "/v1/instances", "post", api.post("/v1/instances", json={"hosts": ["a"]}))
    check(spec, "/v1/instances/{instance_id}", "get", api.get("/v1/instances/inst-nope"))


def test_a_token_shows_as_a_security_scheme_except_on_health(stack: Stack) -> None:
    settings = api_settings(stack.redis.url, [], api_token="t0ken")
    with serving(settings) as api:
        spec = api.get("/openapi.json", headers={"Authorization": "Bearer t0ken"}).json()
    assert spec["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    assert spec["security"] == [{"bearer": []}]
    assert spec["paths"]["/healthz"]["get"]["security"] == []
    assert "401" in spec["paths"]["/v1/jobs"]["post"]["responses"]
