"""OpenAI's Files and Batch API on the queue, driven by the official `openai` client against the
session stack (a real worker, whose feeder drives the batches, and its tiny model's runner)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import requests

from tests.support.api import api_settings, serving
from tests.support.batches import (
    CHAT_URL,
    chat_line,
    jsonl,
    read_file,
    start,
    wait_status,
)
from tests.support.clients import client_for
from tests.support.stack import Stack

ENDED = {"completed", "failed", "cancelled", "expired"}
# What differs between two answers to the same request, as between two of OpenAI's own.
VOLATILE = ("id", "created")


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with client_for(stack.api) as client:
        yield client


def stable(body: dict[str, Any]) -> dict[str, Any]:
    """The answer without what differs between two asks of one request: ids, times, and the
    prompt tokens the runner's prompt cache happened to hold."""
    kept = {k: v for k, v in body.items() if k not in VOLATILE}
    if "usage" in kept:
        kept["usage"] = {k: v for k, v in kept["usage"].items() if k != "prompt_tokens_details"}
    return kept


def test_upload_create_poll_download_equals_direct_answers(
    stack: Stack, client: openai.OpenAI
) -> None:
    lines = [chat_line(f"req-{i}", f"hello {i}", max_tokens=6 + i % 5) for i in range(12)]
    uploaded = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    assert uploaded.object == "file" and uploaded.purpose == "batch"
    assert uploaded.bytes == len(jsonl(lines)) and uploaded.filename == "input.jsonl"
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert uploaded.id in [f.id for f in client.files.list()]
    assert client.files.content(uploaded.id).content == jsonl(lines)

    created = client.batches.create(
        input_file_id=uploaded.id,
        endpoint=CHAT_URL,
        completion_window="24h",
        metadata={"purpose": "test"},
    )
    assert created.status == "validating" and created.metadata == {"purpose": "test"}
    assert created.expires_at == created.created_at + 24 * 3600
    batch = wait_status(client, created.id, ENDED, 120)
    assert batch.status == "completed", batch
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed) == (12, 12)
    assert batch.request_counts.failed == 0 and batch.error_file_id is None
    assert created.id in [b.id for b in client.batches.list(limit=100)]

    output = read_file(client, batch.output_file_id)
    assert [line["custom_id"] for line in output] == [f"req-{i}" for i in range(12)]
    for request, line in zip(lines, output, strict=True):
        assert line["error"] is None and line["response"]["status_code"] == 200
        direct = requests.post(stack.api.url + CHAT_URL, json=request["body"], timeout=60)
        assert direct.status_code == 200
        assert stable(line["response"]["body"]) == stable(direct.json())
        # The body renders as the route renders it: the same fields, in the same order.
        assert json.dumps(stable(line["response"]["body"]), sort_keys=True) == json.dumps(
            stable(direct.json()), sort_keys=True
        )
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_completions_endpoint(client: openai.OpenAI) -> None:
    line = {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "tiny", "prompt": "once", "max_tokens": 5, "temperature": 0},
    }
    batch = wait_status(client, start(client, [line], "/v1/completions").id, ENDED, 60)
    (out,) = read_file(client, batch.output_file_id)
    direct = client.completions.create(model="tiny", prompt="once", max_tokens=5, temperature=0)
    assert out["response"]["body"]["object"] == "text_completion"
    assert out["response"]["body"]["choices"][0]["text"] == direct.choices[0].text


def test_bad_lines_fail_the_line_bad_format_fails_the_file(client: openai.OpenAI) -> None:
    good = chat_line("good", "hi")
    unknown_model = chat_line("unknown-model", "hi", model="no-such-model")
    invalid_body = chat_line("invalid-body", "hi", max_tokens="many")
    batch = wait_status(client, start(client, [good, unknown_model, invalid_body]).id, ENDED, 60)
    assert batch.status == "completed"
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 2)
    assert [o["custom_id"] for o in read_file(client, batch.output_file_id)] == ["good"]
    errors = {e["custom_id"]: e for e in read_file(client, batch.error_file_id)}
    model_error = errors["unknown-model"]["response"]
    assert model_error["status_code"] == 404
    assert model_error["body"]["error"]["code"] == "model_not_found"
    body_error = errors["invalid-body"]["response"]
    assert body_error["status_code"] == 400
    assert body_error["body"]["error"]["param"] == "max_tokens"

    # A line that is not JSON, a duplicated custom_id, a wrong url: the whole file fails.
    wrong_url = {**chat_line("x", "hi"), "url": "/v1/embeddings"}
    lines = [good, "{not json", chat_line("good", "again"), wrong_url]
    failed = wait_status(client, start(client, lines).id, ENDED, 30)
    assert failed.status == "failed" and failed.failed_at is not None
    assert failed.errors is not None and failed.errors.data is not None
    found = {(e.code, e.line) for e in failed.errors.data}
    assert found == {
        ("invalid_json_line", 2),
        ("duplicate_custom_id", 3),
        ("mismatched_endpoint", 4),
    }
    assert failed.output_file_id is None and failed.error_file_id is None


def test_cancel_midway_keeps_finished_lines(client: openai.OpenAI) -> None:
    lines = [chat_line(f"r{i}", "go", max_tokens=200, ignore_eos=True) for i in range(150)]
    batch = start(client, lines)

    def some_done() -> bool:
        counts = client.batches.retrieve(batch.id).request_counts
        return counts is not None and counts.completed >= 3

    wait_status_by(some_done, 90)
    cancelling = client.batches.cancel(batch.id)
    # Read again after its jobs in flight were cancelled: on a loaded machine the feeder may
    # have ended it by then.
    assert cancelling.status in ("cancelling", "cancelled"), cancelling.status
    assert cancelling.cancelling_at is not None
    began = time.monotonic()
    ended = wait_status(client, batch.id, ENDED, 30)
    took = time.monotonic() - began
    assert ended.status == "cancelled" and ended.cancelled_at is not None
    assert took < 5.0, f"cancelled after {took:.1f}s"
    output = read_file(client, ended.output_file_id)
    errors = read_file(client, ended.error_file_id)
    assert len(output) >= 3 and all(o["response"]["status_code"] == 200 for o in output)
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    ids = [line["custom_id"] for line in output + errors]
    assert sorted(ids) == sorted(f"r{i}" for i in range(150))  # every line exactly once
    assert ended.request_counts is not None
    assert ended.request_counts.completed == len(output)
    assert ended.request_counts.failed == len(errors)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_expiry_keeps_what_finished(client: openai.OpenAI) -> None:
    # A few short lines first, so some finish within the window however slow the machine is.
    short = [chat_line(f"s{i}", "go", max_tokens=8, ignore_eos=True) for i in range(8)]
    long = [chat_line(f"e{i}", "go", max_tokens=300, ignore_eos=True) for i in range(192)]
    batch = start(client, short + long, window="6s")
    assert batch.expires_at == batch.created_at + 6
    ended = wait_status(client, batch.id, ENDED, 40)
    assert ended.status == "expired" and ended.expired_at is not None
    assert ended.expired_at >= batch.expires_at
    output = read_file(client, ended.output_file_id)
    errors = read_file(client, ended.error_file_id)
    assert {"s0", "s1"} <= {line["custom_id"] for line in output}, "what finished is kept"
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert len(output) + len(errors) == 200


def test_interactive_request_is_served_during_a_batch(stack: Stack, client: openai.OpenAI) -> None:
    lines = [chat_line(f"i{i}", "go", max_tokens=64, ignore_eos=True) for i in range(500)]
    batch = start(client, lines)
    seen: list[int] = []

    def moving() -> bool:
        counts = client.batches.retrieve(batch.id).request_counts
        if counts is not None and counts.completed:
            seen.append(counts.completed)
        return len(set(seen)) >= 3

    wait_status_by(moving, 120)
    assert seen == sorted(seen)
    began = time.monotonic()
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "now"}], max_tokens=8, stream=True
    )
    first = next(chunk for chunk in stream if chunk.choices and chunk.choices[0].delta.content)
    ttft = time.monotonic() - began
    assert first is not None and ttft < 3.0, f"first token after {ttft:.2f}s"
    queued = stack.store.jobs.queue_depth("exo.model.tiny")
    assert queued <= stack.api.app.extensions["exo"].settings.batch_max_queued
    metrics = stack.api.get("/metrics").text
    assert "exo_batches_running 1.0" in metrics
    assert 'exo_batch_requests_total{status="completed"}' in metrics
    client.batches.cancel(batch.id)
    wait_status(client, batch.id, ENDED, 30)


def test_limits_answer_in_openai_shape(stack: Stack) -> None:
    small = api_settings(stack.redis.url, [], batch_max_file_bytes=1000, batch_max_lines=3)
    with serving(small) as api:
        big = api.post(
            "/v1/files", files={"file": ("a.jsonl", b"x" * 2000)}, data={"purpose": "batch"}
        )
        assert big.status_code == 413
        assert big.json()["error"]["type"] == "invalid_request_error"
        assert big.json()["error"]["param"] == "file"
        many = jsonl([chat_line(str(i), "hi") for i in range(4)])
        too_many = api.post(
            "/v1/files", files={"file": ("a.jsonl", many)}, data={"purpose": "batch"}
        )
        assert too_many.status_code == 400 and "EXO_BATCH_MAX_LINES" in too_many.text
        purpose = api.post("/v1/files", files={"file": ("a.jsonl", b"{}")}, data={"purpose": "x"})
        assert purpose.status_code == 400 and purpose.json()["error"]["param"] == "purpose"
        window = api.post(
            "/v1/batches",
            json={"input_file_id": "f", "endpoint": CHAT_URL, "completion_window": "2d"},
        )
        assert window.status_code == 400
        assert window.json()["error"]["param"] == "completion_window"
        missing = api.post("/v1/batches", json={"input_file_id": "nope", "endpoint": CHAT_URL})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "input_file_id"


def test_files_and_batches_need_the_token(stack: Stack) -> None:
    with serving(api_settings(stack.redis.url, [], api_token="s3cret")) as api:
        assert api.get("/v1/files").status_code == 401
        assert api.get("/v1/batches").status_code == 401
        authorized = {"Authorization": "Bearer s3cret"}
        assert api.get("/v1/batches", headers=authorized).status_code == 200
        spec = api.get("/openapi.json", headers=authorized).json()
    for path in ("/v1/files", "/v1/files/{file_id}/content", "/v1/batches/{batch_id}/cancel"):
        assert path in spec["paths"], path


def wait_status_by(condition: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
