"""Jobs end to end: HTTP → Celery on Redis → worker → runner (real MLX) → Redis → HTTP."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.support import sse
from tests.support.stack import Stack

# Long enough that the eight run together even when their submissions spread out: through the
# tests' in-process API on a loaded machine they came up to a second apart, and jobs of 160
# tokens ended in batches of 3 to 5.
TOKENS = 640
PROMPTS = ["hello", "The quick brown fox", "a", "1234", "Once upon a time", "xyz", "Q:", "tea"]


@pytest.fixture(scope="module")
def mlx_reference(tiny_model: Path) -> Any:
    """What mlx-lm itself produces for a prompt, greedy, generating alone."""
    import mlx_lm

    loaded = mlx_lm.load(str(tiny_model))
    model, tokenizer = loaded[0], loaded[1]

    def generate(prompt: str, max_tokens: int) -> str:
        tokens = [
            r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)
        ]
        text: str = tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids])
        return text

    return generate


def test_submit_then_get_returns_output_usage_and_timings(stack: Stack) -> None:
    created = stack.api.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 16})
    assert created.status_code == 202
    assert created.json()["status"] == "queued"
    job = stack.api.wait_job(created.json()["id"])
    assert job["status"] == "succeeded"
    assert job["model"] == "tiny" and job["host"] == "host-a" and job["runner_id"] == "tiny@host-a"
    assert len(job["output"]["text"]) > 0 and job["output"]["finish_reason"] == "length"
    usage = job["usage"]
    assert usage | {"prompt_tokens_details": None} == {
        "prompt_tokens": 5,
        "completion_tokens": 16,
        "total_tokens": 21,
        "prompt_tokens_details": None,
    }
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < 5  # earlier jobs said hello
    assert job["timings"]["queue_ms"] >= 0 and job["timings"]["ttft_ms"] > 0
    assert job["timings"]["tokens_per_s"] > 0
    assert job["started_at"] <= job["finished_at"]


def test_eight_concurrent_jobs_share_one_batch_and_match_mlx_lm(
    stack: Stack, mlx_reference: Any
) -> None:
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda p: stack.api.submit(prompt=p, max_tokens=TOKENS), PROMPTS))
    jobs = [stack.api.wait_job(job_id) for job_id in ids]
    for prompt, job in zip(PROMPTS, jobs, strict=True):
        assert job["status"] == "succeeded"
        assert job["output"]["text"] == mlx_reference(prompt, TOKENS), prompt
    runner = stack.api.get("/v1/runners/tiny@host-a").json()
    assert runner["largest_batch"] >= 8 and runner["lanes"] == 2


def test_ten_jobs_in_a_row_load_the_model_once(stack: Stack) -> None:
    before = stack.api.get("/v1/runners/tiny@host-a").json()
    for i in range(10):
        job = stack.api.wait_job(stack.api.submit(prompt=f"job {i}", max_tokens=4))
        assert job["status"] == "succeeded"
    after = stack.api.get("/v1/runners/tiny@host-a").json()
    assert after["model_loads"] == 1
    assert after["pid"] == before["pid"]


def test_stream_delivers_every_token_then_done(stack: Stack) -> None:
    job_id = stack.api.submit(prompt="stream me", max_tokens=32, ignore_eos=True)
    response = stack.api.get(f"/v1/jobs/{job_id}/stream")
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = sse.parse(response.text)
    tokens = [e for e in events if e["event"] == "token"]
    assert events[-1]["event"] == "done"
    final = events[-1]["data"]
    assert final["status"] == "succeeded"
    assert "".join(t["data"]["text"] for t in tokens) == final["output"]["text"]
    assert [t["data"]["index"] for t in tokens] == list(range(len(tokens)))
    assert all(e["id"] for e in events)


def test_stream_resumes_after_last_event_id(stack: Stack) -> None:
    job_id = stack.api.submit(prompt="resume", max_tokens=12, ignore_eos=True)
    full = sse.parse(stack.api.get(f"/v1/jobs/{job_id}/stream").text)
    resumed = sse.parse(
        stack.api.get(f"/v1/jobs/{job_id}/stream", headers={"Last-Event-ID": full[4]["id"]}).text
    )
    assert resumed == full[5:]


def test_ignore_eos_generates_exactly_max_tokens(stack: Stack) -> None:
    job = stack.api.wait_job(stack.api.submit(prompt="x", max_tokens=40, ignore_eos=True))
    assert job["usage"]["completion_tokens"] == 40
    assert job["output"]["finish_reason"] == "length"


def test_stop_string_cuts_the_output(stack: Stack) -> None:
    free = stack.api.wait_job(stack.api.submit(prompt="hello", max_tokens=24))
    stop = free["output"]["text"][6:8]
    job = stack.api.wait_job(stack.api.submit(prompt="hello", max_tokens=24, stop=[stop]))
    assert job["output"]["finish_reason"] == "stop"
    assert job["output"]["text"] == free["output"]["text"].split(stop)[0]


def test_seed_makes_sampling_reproducible(stack: Stack) -> None:
    def sampled(seed: int) -> str:
        body = {
            "prompt": "dice",
            "max_tokens": 24,
            "temperature": 1.0,
            "seed": seed,
            "ignore_eos": True,
        }
        text: str = stack.api.wait_job(stack.api.submit(**body))["output"]["text"]
        return text

    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)


def test_chat_messages_are_accepted(stack: Stack) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    job = stack.api.wait_job(stack.api.submit(messages=messages, max_tokens=8))
    assert job["status"] == "succeeded"
    assert job["usage"]["prompt_tokens"] > len("be brief hi")


def test_list_jobs_filters_by_status(stack: Stack) -> None:
    job_id = stack.api.submit(prompt="listed", max_tokens=2)
    stack.api.wait_job(job_id)
    listed = stack.api.get("/v1/jobs", params={"status": "succeeded"}).json()
    assert job_id in [j["id"] for j in listed]
    assert {j["status"] for j in listed} == {"succeeded"}


def test_finished_jobs_expire(stack: Stack) -> None:
    job_id = stack.api.submit(prompt="ttl", max_tokens=2)
    stack.api.wait_job(job_id)
    ttl = stack.store.redis.ttl(f"exo:job:{job_id}")
    assert 0 < ttl <= 24 * 3600


def test_unknown_job_is_404_in_the_error_shape(stack: Stack) -> None:
    for path in ("/v1/jobs/nope", "/v1/jobs/nope/stream", "/v1/runners/nope@x"):
        response = stack.api.get(path)
        assert response.status_code == 404
        assert response.json()["error"]["type"] == "not_found"
    assert stack.api.get("/no/such/route").json()["error"]["type"] == "not_found"
