"""Resumable job streams: GET /v1/jobs/<id>/stream with Last-Event-ID loses and repeats nothing."""

from __future__ import annotations

from typing import Any

from tests.support import sse
from tests.support.clients import HOST_A
from tests.support.stack import Stack


def test_a_client_that_connects_after_the_job_finished_gets_the_whole_stream(
    stack: Stack,
) -> None:
    job = stack.api.wait_job(
        stack.api.submit(prompt="late", max_tokens=30, ignore_eos=True, **HOST_A)
    )
    events = sse.parse(stack.api.get(f"/v1/jobs/{job['id']}/stream").text)
    tokens = [e["data"] for e in events if e["event"] == "token"]
    assert [t["index"] for t in tokens] == list(range(30))
    assert "".join(t["text"] for t in tokens) == job["output"]["text"]
    assert events[-1]["event"] == "done" and events[-1]["data"] == job


def test_a_stream_resumed_mid_run_loses_and_repeats_nothing(stack: Stack) -> None:
    job_id = stack.api.submit(prompt="resume", max_tokens=1500, ignore_eos=True, **HOST_A)
    first = stack.api.get(f"/v1/jobs/{job_id}/stream", stream=True)
    seen: list[dict[str, Any]] = []
    for event in sse.read(first):
        seen.append(event)
        if len(seen) == 25:
            break
    first.close()
    assert stack.api.get(f"/v1/jobs/{job_id}").json()["status"] == "running"  # mid-run, really

    resumed = stack.api.get(
        f"/v1/jobs/{job_id}/stream", headers={"Last-Event-ID": seen[-1]["id"]}, stream=True
    )
    rest = list(sse.read(resumed))
    events = seen + rest
    assert events[-1]["event"] == "done"
    job = events[-1]["data"]
    tokens = [e["data"] for e in events if e["event"] == "token"]
    assert [t["index"] for t in tokens] == list(range(job["usage"]["completion_tokens"]))
    assert "".join(t["text"] for t in tokens) == job["output"]["text"]
    assert len(tokens) == 1500 and rest[0]["data"]["index"] == 25
