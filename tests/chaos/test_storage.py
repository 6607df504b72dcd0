"""A few requests cannot fill Redis for everyone (issue 27, finding 8): log probabilities are
kept compactly, a job that would keep more than EXO_MAX_JOB_BYTES fails alone naming it, and
once clients' data fills Redis to its maxmemory less EXO_REDIS_RESERVE_MB, new jobs get 503
while the fleet's own writes (a running job's tokens and ending, cancels, heartbeats) go on."""

from __future__ import annotations

import threading
from datetime import datetime
from pathlib import Path
from typing import Any

import redis as redis_lib
import requests

from exo_tasks.store import Store
from exo_tasks.store.keys import endings_key, events_key, job_key
from tests.support import sse
from tests.support.api import api_settings, serving
from tests.support.processes import Processes, start_redis, wait_until
from tests.support.stack import Stack, new_worker
from tests.support.workers import new_worker as new_worker_on
from tests.support.workers import runner_state

LOGPROBS = {"logprobs": True, "top_logprobs": 20}


def stored_bytes(store: Store, job_id: str) -> int:
    keys = (job_key(job_id), events_key(job_id), endings_key(job_id))
    return sum(store.redis.memory_usage(key, samples=0) or 0 for key in keys)


def test_logprobs_are_stored_compactly_and_read_back_whole(stack: Stack) -> None:
    """1,024 tokens with 20 alternatives each kept 5.2 MB (5,107 bytes a token: as objects,
    with their bytes, four times over); now under 1,000 bytes a token. Without logprobs a token
    keeps 78 bytes."""
    body = {"prompt": "measure", "max_tokens": 1024, "ignore_eos": True, **LOGPROBS}
    job_id = stack.api.submit(**body)
    job = stack.api.wait_job(job_id, timeout_s=120)
    assert job["status"] == "succeeded", job
    per_token = stored_bytes(stack.store, job_id) / 1024
    assert per_token < 1000, f"{per_token:.0f} bytes a token"

    logprobs = job["output"]["logprobs"]
    assert len(logprobs) == 1024
    for entry in logprobs:
        assert len(entry["top_logprobs"]) == 20
        for each in [entry, *entry["top_logprobs"]]:
            assert each["bytes"] == list(each["token"].encode())
            assert each["logprob"] <= 0
    stream = requests.get(f"{stack.api.url}/v1/jobs/{job_id}/stream", timeout=30)
    events = sse.parse(stream.text)
    streamed = [lp for e in events if e["event"] == "token" for lp in e["data"]["logprobs"]]
    assert streamed == logprobs
    assert events[-1]["event"] == "done" and events[-1]["data"]["output"]["logprobs"] == logprobs


def test_an_openai_answer_has_its_logprobs(stack: Stack) -> None:
    """The jobs' endings no longer carry logprobs (the record does): a whole answer reads
    them there."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 5, "logprobs": 3}
    answer = stack.api.post("/v1/completions", json=body).json()
    logprobs = answer["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 5 and all(len(top) == 3 for top in logprobs["top_logprobs"])


def test_a_job_past_its_storage_bound_fails_alone_naming_it(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    new_worker(stack, processes, tiny_model, tmp_path, "st-bound", max_job_bytes=1 << 16)
    pid = runner_state(stack.store, "st-bound").pid
    beside = stack.api.submit(prompt="beside", max_tokens=300, ignore_eos=True, host="st-bound")
    heavy = {"prompt": "heavy", "max_tokens": 1024, "ignore_eos": True, **LOGPROBS}
    job = stack.api.wait_job(stack.api.submit(**heavy, host="st-bound"))
    assert job["status"] == "failed", job
    assert "more than 65536 bytes of storage (EXO_MAX_JOB_BYTES)" in job["error"]
    assert 0 < job["usage"]["completion_tokens"] < 1024 and job["output"]["text"]
    assert stored_bytes(stack.store, job["id"]) < 2 * (1 << 16)
    assert stack.api.wait_job(beside)["status"] == "succeeded"
    assert runner_state(stack.store, "st-bound").pid == pid


# --- Redis filled by clients ---

MAXMEMORY_MB = 32  # a quarter of it, 8 MB, is the fleet's


def fill(redis_url: str, until_mb: float) -> int:
    """Clients' data already there (earlier jobs, say), up to `until_mb`."""
    client = redis_lib.Redis.from_url(redis_url)
    count = 0
    while client.info("memory")["used_memory"] < until_mb * (1 << 20):
        client.set(f"exo:filler:{count}", "x" * 100_000)
        count += 1
    return count


def test_clients_filling_redis_leave_room_for_the_fleet(
    processes: Processes, tmp_path: Path, tiny_model: Path
) -> None:
    """Before, Redis refused every write once clients' jobs filled it: a running job's tokens
    and ending, heartbeats and cancels too, until records expired a day later."""
    redis = start_redis(processes, tmp_path / "redis", maxmemory_mb=MAXMEMORY_MB)
    store = Store.from_url(redis.url)
    new_worker_on(processes, redis.url, store, "st-full", [tiny_model], tmp_path)
    with serving(api_settings(redis.url, [tiny_model])) as api:
        bystander = Bystander(api.url, api.submit(prompt="by", max_tokens=3000, ignore_eos=True))
        to_cancel = api.submit(prompt="cancel me", max_tokens=4000, ignore_eos=True)
        fill(redis.url, MAXMEMORY_MB - 9)
        for _ in range(500):  # clients' jobs, 8 KB of prompt each, until the API refuses them
            response = api.post("/v1/jobs", json={"prompt": "p" * 8_000, "max_tokens": 1})
            if response.status_code != 202:
                break
        error = response.json()["error"]
        assert response.status_code == 503 and error["type"] == "storage_full", error
        assert "EXO_REDIS_RESERVE_MB" in error["message"]
        fill(redis.url, MAXMEMORY_MB - 7)  # past the reserve's edge, where memory wavers
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        assert api.post("/v1/chat/completions", json=chat).status_code == 503

        # The fleet's writes go on: heartbeats, a cancel, the bystander's tokens and ending.
        beat = store.hosts.get("st-full")
        assert beat is not None
        wait_until(lambda: newer_beat(store, beat.updated_at), 10, "a heartbeat written")
        assert api.post(f"/v1/jobs/{to_cancel}/cancel").status_code == 202
        assert api.wait_job(to_cancel)["status"] == "cancelled"
        job = api.wait_job(bystander.job_id)
        bystander.reader.join(30)
        assert job["status"] == "succeeded"
        # Its stream's last event (an `error` event, if it fell too far behind, has no status).
        assert bystander.ending.get("status") == "succeeded", bystander.ending
        assert "".join(bystander.tokens) == job["output"]["text"] and len(bystander.tokens) == 3000
        used, limit = store.metrics.memory()
        assert used < limit


def newer_beat(store: Store, than: datetime) -> bool:
    state = store.hosts.get("st-full")
    return state is not None and state.updated_at > than


class Bystander:
    """A job's stream, read in a thread."""

    def __init__(self, url: str, job_id: str) -> None:
        self.url, self.job_id = url, job_id
        self.tokens: list[str] = []
        self.ending: dict[str, Any] = {}
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        wait_until(lambda: len(self.tokens) >= 5, 30, "the bystander's first tokens")

    def _read(self) -> None:
        url = f"{self.url}/v1/jobs/{self.job_id}/stream"
        with requests.get(url, stream=True, timeout=60) as response:
            for event in sse.read(response):
                if event["event"] == "token":
                    self.tokens.append(event["data"]["text"])
                else:
                    self.ending.update(event["data"])
