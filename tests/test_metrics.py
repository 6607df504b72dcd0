"""GET /metrics: Prometheus text, kept in Redis, so every API process and host agrees.

A host of its own serves the model `omega` (one pool child), so the counts here are exact."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from exo_tasks.modelgen import create_model
from exo_tasks.store import Store
from tests.support.metrics import Samples, parse, scrape, value
from tests.support.processes import (
    Processes,
    RedisServer,
    start_api,
    wait_until,
)
from tests.support.stack import Stack
from tests.support.workers import Worker, start_worker, wait_runner_ready

HISTOGRAMS = (
    "exo_time_to_first_token_seconds",
    "exo_inter_token_latency_seconds",
    "exo_e2e_request_latency_seconds",
    "exo_request_queue_time_seconds",
)


@pytest.fixture(scope="module")
def omega(
    redis_server: RedisServer, store: Store, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    processes = Processes()
    try:
        data_dir = tmp_path_factory.mktemp("omega")
        model = create_model("tiny", data_dir / "omega")
        worker = start_worker(
            processes, redis_server.url, "omega-host", [model], data_dir, worker_concurrency=1
        )
        wait_runner_ready(store, worker, "omega")
        yield worker
    finally:
        processes.stop_all()


def seconds(job: dict[str, Any], since: str, until: str) -> float:
    return (datetime.fromisoformat(job[until]) - datetime.fromisoformat(job[since])).total_seconds()


def test_jobs_count_their_status_tokens_and_latencies(stack: Stack, omega: Worker) -> None:
    before = scrape(stack.api.url)
    ids = [
        stack.api.submit(prompt=f"m{i}", max_tokens=10, ignore_eos=True, model="omega")
        for i in range(3)
    ]
    jobs = [stack.api.wait_job(job_id) for job_id in ids]
    assert all(job["status"] == "succeeded" for job in jobs)
    # Counted in the write that ends each job: a job read as ended is counted (CI scraped
    # between the two when a second round trip counted it).
    after = scrape(stack.api.url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    ended = delta("exo_request_success_total", model="omega", status="succeeded")
    assert ended == 3
    assert delta("exo_generation_tokens_total", model="omega") == 30
    prompt_tokens = sum(job["usage"]["prompt_tokens"] for job in jobs)
    assert delta("exo_prompt_tokens_total", model="omega") == prompt_tokens > 0
    assert delta("exo_time_to_first_token_seconds_count", model="omega") == 3
    assert delta("exo_request_queue_time_seconds_count", model="omega") == 3
    assert delta("exo_e2e_request_latency_seconds_count", model="omega") == 3
    assert delta("exo_inter_token_latency_seconds_count", model="omega") == 3 * 9
    e2e = sum(seconds(job, "created_at", "finished_at") for job in jobs)
    assert delta("exo_e2e_request_latency_seconds_sum", model="omega") == pytest.approx(e2e)
    ttft = sum(seconds(job, "created_at", "first_token_at") for job in jobs)
    assert delta("exo_time_to_first_token_seconds_sum", model="omega") == pytest.approx(ttft)
    queued = sum(seconds(job, "created_at", "started_at") for job in jobs)
    # The records' own waits (CI: the runner's admission, measured before, was 0.5 s later).
    assert delta("exo_request_queue_time_seconds_sum", model="omega") == pytest.approx(queued)
    itl = delta("exo_inter_token_latency_seconds_sum", model="omega")
    assert 0 < itl < e2e
    for name in HISTOGRAMS:  # cumulative buckets that end at the count
        buckets = sorted(
            (float(dict(labels)["le"]), v)
            for (sample, labels), v in after.items()
            if sample == f"{name}_bucket" and ("model", "omega") in labels
        )
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and counts[-1] == value(
            after, f"{name}_count", model="omega"
        )


def test_gauges_show_running_and_waiting_jobs(stack: Stack, omega: Worker) -> None:
    before = scrape(stack.api.url)
    long = {"prompt": "long", "max_tokens": 4000, "ignore_eos": True, "model": "omega"}
    running = stack.api.submit(**long)
    wait_until(lambda: stack.api.get(f"/v1/jobs/{running}").json()["status"] == "running", 30, "")
    waiting = [stack.api.submit(**long) for _ in range(2)]
    try:
        now = scrape(stack.api.url)
        assert value(now, "exo_num_requests_running", model="omega") == 1
        assert value(now, "exo_num_requests_waiting", model="omega") == 2
    finally:
        for job_id in (*waiting, running):
            stack.api.post(f"/v1/jobs/{job_id}/cancel")
    for job_id in (running, *waiting):
        assert stack.api.wait_job(job_id)["status"] == "cancelled"

    def settled() -> Samples | None:
        samples = scrape(stack.api.url)
        idle = value(samples, "exo_num_requests_running", model="omega") == 0
        return (
            samples
            if idle and value(samples, "exo_num_requests_waiting", model="omega") == 0
            else None
        )

    after: Samples = wait_until(settled, 10, "omega to be idle")
    cancelled = {"model": "omega", "status": "cancelled"}
    assert (
        value(after, "exo_request_success_total", **cancelled)
        - value(before, "exo_request_success_total", **cancelled)
        == 3
    )


def test_a_runner_restart_is_counted(stack: Stack, omega: Worker) -> None:
    labels = {"model": "omega", "host": "omega-host"}
    before = value(scrape(stack.api.url), "exo_runner_restarts_total", **labels)
    state = stack.store.runners.get("omega@omega-host")
    assert state is not None and state.pid is not None
    os.kill(state.pid, signal.SIGKILL)
    wait_until(
        lambda: (
            (s := stack.store.runners.get("omega@omega-host")) is not None
            and s.pid != state.pid
            and s.status.accepts_jobs
        ),
        60,
        "the runner to be restarted",
    )
    assert value(scrape(stack.api.url), "exo_runner_restarts_total", **labels) == before + 1


def test_every_gunicorn_worker_answers_the_same_numbers(
    stack: Stack, omega: Worker, processes: Processes, tmp_path: Any
) -> None:
    settings = {"redis_url": stack.redis.url, "api_workers": 3, "data_dir": tmp_path}
    url = start_api(processes, tmp_path / "api.log", **settings).url
    stack.api.wait_job(stack.api.submit(prompt="g", max_tokens=3, model="omega"))
    reference = scrape(stack.api.url)
    stored = {k: v for k, v in reference.items() if not k[0].startswith("exo_num_requests")}
    for _ in range(12):  # a fresh connection each time, spread over the workers
        with requests.Session() as session:
            text = session.get(f"{url}/metrics", timeout=10).text
        answer = parse(text)
        assert {k: answer.get(k) for k in stored} == stored


def test_metrics_list_every_metric_with_help_and_type(stack: Stack) -> None:
    text = stack.api.get("/metrics").text
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    expected = {
        **dict.fromkeys(HISTOGRAMS, "histogram"),
        "exo_num_requests_running": "gauge",
        "exo_num_requests_waiting": "gauge",
        "exo_prompt_tokens": "counter",
        "exo_generation_tokens": "counter",
        "exo_request_success": "counter",
        "exo_runner_restarts": "counter",
    }
    assert {name: families.get(name) for name in expected} == expected
    assert "# HELP exo_time_to_first_token_seconds " in text
