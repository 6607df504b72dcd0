"""Property-based fuzzing of every route with schemathesis, against /openapi.json of the live
API (its own redis-server and a worker with the tiny model): no 5xx, and every 4xx in the
documented error shape."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings

from exo_tasks.store import Store
from tests.support.api import Api, api_settings, serving
from tests.support.processes import Processes, start_redis
from tests.support.report import Case, Report
from tests.support.workers import start_worker, wait_runner_ready

# Routes that answer in OpenAI's error shape (no `details`).
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/files", "/v1/batches")


@dataclass
class Fuzzed:
    api: Api
    statuses: Counter[int]


@pytest.fixture(scope="module")
def fuzzed(
    module_processes: Processes,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    reliability: Report,
) -> Iterator[Fuzzed]:
    data_dir = tmp_path_factory.mktemp("fuzz")
    redis = start_redis(module_processes, data_dir / "redis")
    worker = start_worker(module_processes, redis.url, "fuzz-host", [tiny_model], data_dir)
    wait_runner_ready(Store.from_url(redis.url), worker)
    # Small caps keep generated jobs short; short limits bound a request that waits on a job.
    with serving(
        api_settings(redis.url, [tiny_model], max_tokens=16, job_soft_time_limit_s=5)
    ) as api:
        target = Fuzzed(api, Counter())
        yield target
    reliability.add(
        Case(
            "schemathesis over every route of /openapi.json",
            sum(target.statuses.values()),
            "generated requests",
            0,
            [
                f"statuses {dict(sorted(target.statuses.items()))}",
                "no 5xx; every 4xx in the error shape",
            ],
        )
    )


def test_no_route_answers_5xx_and_every_4xx_has_the_error_shape(fuzzed: Fuzzed) -> None:
    import schemathesis  # here, not at collection: every pytest process collects this module
    from schemathesis.core.result import Err, Ok

    schema = schemathesis.openapi.from_url(f"{fuzzed.api.url}/openapi.json")
    results = list(schema.get_all_operations())
    invalid = [r.err() for r in results if isinstance(r, Err)]
    assert not invalid, invalid  # the spec describes every route in valid OpenAPI
    operations = [r.ok() for r in results if isinstance(r, Ok)]
    assert len(operations) >= 17  # every route of the API is in the spec

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        def answers_in_shape(case: Any) -> None:
            response = case.call(base_url=fuzzed.api.url, timeout=30)
            fuzzed.statuses[response.status_code] += 1
            where = (case.method, case.formatted_path, response.text[:300])
            assert response.status_code < 500, where
            if response.status_code >= 400:
                error = response.json()["error"]
                assert isinstance(error["message"], str) and error["message"], where
                assert "type" in error, where
                if not case.formatted_path.startswith(OPENAI_PATHS):
                    assert "details" in error, where

        answers_in_shape()


# Bodies no parser disagreement may turn into a 5xx (issue 27): a lone surrogate in a value and
# in a key, a byte order mark, nesting past the cap, non-finite numbers, neither JSON nor UTF-8.
HOSTILE_BODIES: list[str | bytes] = [
    '{"messages": [{"role": "user", "content": "\\ud800"}], "prompt": "\\udfff"}',
    '{"metadata": {"\\ud800": "x"}, "model": "\\udc00"}',
    '"\\ud800"',
    "\ufeff{}".encode(),
    '{"a": ' + "[" * 300 + "]" * 300 + "}",
    '{"prompt": "a", "temperature": NaN, "top_p": 1e999}',
    "not json",
    b"\xff\xfe{}",
]


def test_every_route_with_a_body_refuses_hostile_json_in_shape(fuzzed: Fuzzed) -> None:
    spec = requests.get(f"{fuzzed.api.url}/openapi.json", timeout=10).json()
    sent = 0
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            content = operation.get("requestBody", {}).get("content", {})
            if "application/json" not in content:
                continue
            url = fuzzed.api.url + path.replace("{", "").replace("}", "")
            for body in HOSTILE_BODIES:
                response = requests.request(
                    method, url, data=body, headers={"Content-Type": "application/json"}, timeout=30
                )
                sent += 1
                fuzzed.statuses[response.status_code] += 1
                where = (method, path, body[:80], response.text[:300])
                assert 400 <= response.status_code < 500, where
                error = response.json()["error"]
                assert isinstance(error["message"], str) and error["message"], where
    assert sent >= 7 * len(HOSTILE_BODIES)  # jobs, runners (2), hosts, chat, completions, batches
