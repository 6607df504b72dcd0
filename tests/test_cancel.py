"""Cancelling jobs: by the route, or by a streaming client that goes away.

Tests that need a runner to themselves start their own worker (its own host, jobs pinned to it).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import openai
import requests

from exo_tasks.types import DoneEvent
from tests.support.clients import CHAT, HOST_A, client_for, job_of
from tests.support.processes import Processes, wait_until
from tests.support.stack import LONG, Stack, new_worker, wait_tokens
from tests.support.workers import runner_state


def cancel(stack: Stack, job_id: str) -> requests.Response:
    return stack.api.post(f"/v1/jobs/{job_id}/cancel")


def test_cancel_is_404_for_an_unknown_job_and_409_once_it_ended(stack: Stack) -> None:
    unknown = cancel(stack, "no-such-job")
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found"
    job_id = stack.api.submit(prompt="done", max_tokens=2, **HOST_A)
    assert stack.api.wait_job(job_id)["status"] == "succeeded"
    ended = cancel(stack, job_id)
    assert ended.status_code == 409
    assert ended.json()["error"]["details"] == {"status": "succeeded"}


def busy_worker(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path, host: str
) -> str:
    """A worker with one pool child, kept busy by a long job (returned): the next job queues."""
    new_worker(stack, processes, tiny_model, tmp_path, host, worker_concurrency=1)
    busy = stack.api.submit(**LONG, host=host)
    wait_tokens(stack, busy)
    return busy


def test_a_cancelled_queued_job_never_runs(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    busy = busy_worker(stack, processes, tiny_model, tmp_path, "cx-queue")
    queued = stack.api.submit(prompt="never", max_tokens=8, host="cx-queue")
    assert stack.api.get(f"/v1/jobs/{queued}").json()["status"] == "queued"

    response = cancel(stack, queued)
    assert response.status_code == 202
    job = response.json()
    assert job["status"] == "cancelled" and job["output"]["finish_reason"] == "cancelled"
    assert cancel(stack, queued).status_code == 409

    assert cancel(stack, busy).status_code == 202
    assert stack.api.wait_job(busy, timeout_s=2)["status"] == "cancelled"
    # The queue is FIFO with one child: once a later job ran, the cancelled one's turn is past.
    later = stack.api.wait_job(stack.api.submit(prompt="later", max_tokens=4, host="cx-queue"))
    assert later["status"] == "succeeded"
    job = stack.api.get(f"/v1/jobs/{queued}").json()
    assert job["status"] == "cancelled" and job["started_at"] is None
    assert job["runner_id"] is None and job["output"]["text"] == ""
    events = [event for _, event in stack.store.streams.read_events(queued)]
    assert len(events) == 1 and isinstance(events[0], DoneEvent)  # not one token


def test_a_cancelled_running_job_keeps_its_text_and_spares_its_batch_and_model(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    worker = new_worker(stack, processes, tiny_model, tmp_path, "cx-run")
    before = runner_state(stack.store, "cx-run")
    mate_request = {"prompt": "mate", "max_tokens": 800, "ignore_eos": True, "host": "cx-run"}
    long = stack.api.submit(**LONG, host="cx-run")
    mate = stack.api.submit(**mate_request)
    wait_tokens(stack, long)
    wait_tokens(stack, mate)

    started = time.monotonic()
    response = cancel(stack, long)
    assert response.status_code == 202 and response.json()["status"] == "running"
    cancelled = stack.api.wait_job(long, timeout_s=1.5)
    assert time.monotonic() - started < 1.5
    assert cancelled["status"] == "cancelled"
    assert cancelled["output"]["finish_reason"] == "cancelled" and cancelled["error"] is None
    assert 0 < cancelled["usage"]["completion_tokens"] < 4000
    assert cancelled["output"]["text"] == stack.store.streams.streamed_text(long)[0]

    finished = stack.api.wait_job(mate)
    assert finished["status"] == "succeeded" and finished["usage"]["completion_tokens"] == 800
    assert finished["finished_at"] > cancelled["finished_at"]  # it was still in the batch
    alone = stack.api.wait_job(stack.api.submit(**mate_request))
    assert finished["output"]["text"] == alone["output"]["text"]
    after = runner_state(stack.store, "cx-run")
    assert after.pid == before.pid and after.model_loads == before.model_loads == 1
    # The cancel's end in the worker's log: one line at info, no traceback of Celery's Ignore.
    ignored = next(line for line in worker.log_text().splitlines() if f"[{long}] ignored" in line)
    assert "level=info" in ignored and "Traceback" not in ignored
    assert "celery.exceptions.Ignore" not in worker.log_text()


def active_jobs(stack: Stack, host: str) -> int:
    return int(stack.api.get(f"/v1/runners/tiny@{host}").json()["active_jobs"])


def test_a_streaming_client_that_disconnects_cancels_its_job_within_1s(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    new_worker(stack, processes, tiny_model, tmp_path, "cx-cut")
    pid = runner_state(stack.store, "cx-cut").pid
    pinned = {"host": "cx-cut", "ignore_eos": True}
    client = client_for(stack.api)
    streams: dict[str, Any] = {
        "chat": lambda: client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=4000, stream=True, extra_body=pinned
        ),
        "completion": lambda: client.completions.create(
            model="tiny", prompt="go on", max_tokens=4000, stream=True, extra_body=pinned
        ),
    }
    for kind, open_stream in streams.items():
        stream = open_stream()
        job_id = stream.response.headers["x-exo-job-id"]
        for _ in range(20):
            next(stream)
        assert active_jobs(stack, "cx-cut") == 1, kind
        stream.close()
        wait_until(lambda: active_jobs(stack, "cx-cut") == 0, 1.0, f"the {kind} job to stop")
        job = stack.api.wait_job(job_id, timeout_s=1)
        assert job["status"] == "cancelled" and job["output"]["finish_reason"] == "cancelled"
        assert 0 < job["usage"]["completion_tokens"] < 4000, kind
    assert runner_state(stack.store, "cx-cut").pid == pid


def test_a_stream_waiting_in_the_queue_sends_keepalives_and_a_disconnect_cancels_it(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    busy = busy_worker(stack, processes, tiny_model, tmp_path, "cx-wait")
    body = {
        "messages": CHAT,
        "max_tokens": 8,
        "stream": True,
        "host": "cx-wait",
    }
    response = stack.api.post("/v1/chat/completions", json=body, stream=True)
    job_id = response.headers["X-Exo-Job-Id"]
    lines = response.iter_lines(decode_unicode=True)
    assert [next(lines), next(lines)] == [": keepalive", ""]  # at once, before the submission
    assert next(lines).startswith('data: {"id":"chatcmpl-')  # the role chunk, once submitted
    started = time.monotonic()
    comments = [line for line in (next(lines) for _ in range(4)) if line]
    assert comments == [": keepalive", ": keepalive"]
    assert 1.5 < time.monotonic() - started < 3.5  # one a second
    assert stack.api.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
    response.close()
    job = stack.api.wait_job(job_id, timeout_s=3)  # noticed at the next keepalive or two
    assert job["status"] == "cancelled" and job["started_at"] is None
    cancel(stack, busy)


def test_a_cancelled_or_timed_out_request_returns_its_text_as_length(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    new_worker(stack, processes, tiny_model, tmp_path, "cx-map")
    client = client_for(stack.api)
    request: dict[str, Any] = {"model": "tiny", "messages": CHAT, "max_tokens": 4000}
    timed = client.chat.completions.create(
        **request, extra_body={"host": "cx-map", "ignore_eos": True, "timeout_s": 1}
    )
    assert job_of(stack.api, timed.id)["status"] == "timed_out"
    assert timed.choices[0].finish_reason == "length" and timed.choices[0].message.content
    assert timed.usage is not None and 0 < timed.usage.completion_tokens < 4000

    answers: list[openai.types.chat.ChatCompletion] = []
    waiter = threading.Thread(
        target=lambda: answers.append(
            client.chat.completions.create(
                **request, extra_body={"host": "cx-map", "ignore_eos": True}
            )
        ),
        daemon=True,
    )
    waiter.start()
    wait_until(lambda: active_jobs(stack, "cx-map") == 1, 10, "the job to run")
    running_jobs = stack.api.get("/v1/jobs", params={"status": "running"}).json()
    (running,) = [job for job in running_jobs if job["runner_id"] == "tiny@cx-map"]
    wait_tokens(stack, running["id"])
    assert cancel(stack, running["id"]).status_code == 202
    waiter.join(timeout=3)
    (answer,) = answers
    assert job_of(stack.api, answer.id)["status"] == "cancelled"
    assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.content
    assert answer.usage is not None and 0 < answer.usage.completion_tokens < 4000
