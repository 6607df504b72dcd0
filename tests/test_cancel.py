"""Cancelling jobs: by the route, or by a streaming client that goes away.

Tests that need a runner to themselves pin their jobs to a host of this module's (a cancel
changes nothing a later test sees): cx-own serves with the usual pool, cx-single with one pool
child. Each test starts once its host is idle.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from exo_tasks.types import DoneEvent
from tests.support.clients import CHAT, HOST_A, client_for, job_of
from tests.support.processes import Processes, wait_until
from tests.support.stack import LONG, Stack, idle, wait_tokens
from tests.support.workers import Worker, runner_state, start_worker, wait_runner_ready

OWN, SINGLE = "cx-own", "cx-single"


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


def active_jobs(stack: Stack, host: str) -> int:
    return int(stack.api.get(f"/v1/runners/tiny@{host}").json()["active_jobs"])


@pytest.fixture(scope="module")
def hosts(
    stack: Stack,
    module_processes: Processes,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Worker]:
    data_dir, url = tmp_path_factory.mktemp("cancel"), stack.redis.url
    hosts = {
        OWN: start_worker(module_processes, url, OWN, [tiny_model], data_dir),
        SINGLE: start_worker(
            module_processes, url, SINGLE, [tiny_model], data_dir, worker_concurrency=1
        ),
    }
    for worker in hosts.values():  # started together: their loads overlap
        wait_runner_ready(stack.store, worker)
    return hosts


@pytest.fixture
def own(stack: Stack, hosts: dict[str, Worker]) -> Worker:
    return idle(stack, hosts[OWN])


@pytest.fixture
def single(stack: Stack, hosts: dict[str, Worker]) -> Worker:
    return idle(stack, hosts[SINGLE])


def busy(stack: Stack, single: Worker) -> str:
    """The host with one pool child kept busy by a long job (returned): the next job queues."""
    busy = stack.api.submit(**LONG, host=single.host)
    wait_tokens(stack, busy)
    return busy


def test_a_cancelled_queued_job_never_runs(stack: Stack, single: Worker) -> None:
    busy_job = busy(stack, single)
    queued = stack.api.submit(prompt="never", max_tokens=8, host=SINGLE)
    assert stack.api.get(f"/v1/jobs/{queued}").json()["status"] == "queued"

    response = cancel(stack, queued)
    assert response.status_code == 202
    job = response.json()
    assert job["status"] == "cancelled" and job["output"]["finish_reason"] == "cancelled"
    assert cancel(stack, queued).status_code == 409

    assert cancel(stack, busy_job).status_code == 202
    assert stack.api.wait_job(busy_job, timeout_s=2)["status"] == "cancelled"
    # The queue is FIFO with one child: once a later job ran, the cancelled one's turn is past.
    later = stack.api.wait_job(stack.api.submit(prompt="later", max_tokens=4, host=SINGLE))
    assert later["status"] == "succeeded"
    job = stack.api.get(f"/v1/jobs/{queued}").json()
    assert job["status"] == "cancelled" and job["started_at"] is None
    assert job["runner_id"] is None and job["output"]["text"] == ""
    events = [event for _, event in stack.store.streams.read_events(queued)]
    assert len(events) == 1 and isinstance(events[0], DoneEvent)  # not one token


def test_a_cancelled_running_job_keeps_its_text_and_spares_its_batch_and_model(
    stack: Stack, own: Worker
) -> None:
    before = runner_state(stack.store, OWN)
    mate_request = {"prompt": "mate", "max_tokens": 800, "ignore_eos": True, "host": OWN}
    long = stack.api.submit(**LONG, host=OWN)
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
    after = runner_state(stack.store, OWN)
    assert after.pid == before.pid and after.model_loads == before.model_loads == 1
    # The cancel's end in the worker's log: one line at info, no traceback of Celery's Ignore.
    ignored = next(line for line in own.log_text().splitlines() if f"[{long}] ignored" in line)
    assert "level=info" in ignored and "Traceback" not in ignored
    assert "celery.exceptions.Ignore" not in own.log_text()


def test_a_streaming_client_that_disconnects_cancels_its_job_within_1s(
    stack: Stack, own: Worker
) -> None:
    pid = runner_state(stack.store, OWN).pid
    pinned = {"host": OWN, "ignore_eos": True}
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
        assert active_jobs(stack, OWN) == 1, kind
        stream.close()
        wait_until(lambda: active_jobs(stack, OWN) == 0, 1.0, f"the {kind} job to stop")
        job = stack.api.wait_job(job_id, timeout_s=1)
        assert job["status"] == "cancelled" and job["output"]["finish_reason"] == "cancelled"
        assert 0 < job["usage"]["completion_tokens"] < 4000, kind
    assert runner_state(stack.store, OWN).pid == pid


def test_a_stream_waiting_in_the_queue_sends_keepalives_and_a_disconnect_cancels_it(
    stack: Stack, single: Worker
) -> None:
    busy_job = busy(stack, single)
    body = {
        "messages": CHAT,
        "max_tokens": 8,
        "stream": True,
        "host": SINGLE,
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
    cancel(stack, busy_job)


def test_a_cancelled_or_timed_out_request_returns_its_text_as_length(
    stack: Stack, own: Worker
) -> None:
    client = client_for(stack.api)
    request: dict[str, Any] = {"model": "tiny", "messages": CHAT, "max_tokens": 4000}
    timed = client.chat.completions.create(
        **request, extra_body={"host": OWN, "ignore_eos": True, "timeout_s": 1}
    )
    assert job_of(stack.api, timed.id)["status"] == "timed_out"
    assert timed.choices[0].finish_reason == "length" and timed.choices[0].message.content
    assert timed.usage is not None and 0 < timed.usage.completion_tokens < 4000

    answers: list[openai.types.chat.ChatCompletion] = []
    waiter = threading.Thread(
        target=lambda: answers.append(
            client.chat.completions.create(**request, extra_body={"host": OWN, "ignore_eos": True})
        ),
        daemon=True,
    )
    waiter.start()
    # The job itself, running: the runner's published count may still hold the timed-out one
    # (it is written after the ending, seen on CI).
    (running,) = wait_until(
        lambda: [
            job
            for job in stack.api.get("/v1/jobs", params={"status": "running"}).json()
            if job["runner_id"] == f"tiny@{OWN}"
        ],
        10,
        "the job to run",
    )
    wait_tokens(stack, running["id"])
    cancelled = cancel(stack, running["id"])
    assert cancelled.status_code == 202, cancelled.text
    waiter.join(timeout=3)
    (answer,) = answers
    assert job_of(stack.api, answer.id)["status"] == "cancelled"
    assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.content
    assert answer.usage is not None and 0 < answer.usage.completion_tokens < 4000
