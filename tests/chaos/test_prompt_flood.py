"""A flood of over-long prompts fails alone: each job with the limit named, no running job, no
stream stalled, the runner never restarted (issue 27, finding 2).

Two layers hold it. The API counts a prompt's tokens with the model's own tokenizer and refuses
what is over EXO_MAX_PROMPT_TOKENS with a 422 before anything is stored or streamed. What the
door cannot judge (a model whose tokenizer it cannot read, chat templates near the cap) reaches
the runner, which refuses a prompt in a bounded share of each round and steps its batch between
refusals, each refusal counting as the runner being alive."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from exo_tasks.fleet_types import RunnerState
from tests.support import sse
from tests.support.api import Api, api_settings, serving
from tests.support.processes import wait_until
from tests.support.stack import Stack
from tests.support.workers import runner_state

CAP_ERROR = "at most 8192 (EXO_MAX_PROMPT_TOKENS)"
# 100,000 characters: EXO_MAX_PROMPT_CHARS, about 12 times the token cap with any tokenizer.
OVER_LONG = "the quick brown fox jumps over the lazy dog. " * 2_222
# Enough for the runner alone to be stalled past its watchdog before the fix (the tiny model
# tokenizes one in 20-30 ms): 150 is the flood; make bench sends 1,000.
FLOOD = 150
# A stall: the runner's watchdog ended it at 5 s before the fix. A quiet machine shows gaps of
# 0.15 s in this flood; three test processes on two cores, 1.4 s.
MAX_GAP_S = 3.0


@dataclass
class Stream:
    """A bystander's job stream, read in a thread: when each token arrived, and the text."""

    api: Api
    job_id: str
    arrivals: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    done: dict[str, Any] = field(default_factory=dict)

    def read(self) -> None:
        url = f"{self.api.url}/v1/jobs/{self.job_id}/stream"
        with requests.get(url, stream=True, timeout=60) as response:
            for event in sse.read(response):
                if event["event"] == "token":
                    self.arrivals.append(time.monotonic())
                    self.texts.append(event["data"]["text"])
                else:
                    self.done = event["data"]
                    return

    def unharmed(self, stack: Stack) -> None:
        """Still streaming after the flood: stopped now (a cancel keeps its text), its stream
        is whole and no token of it came MAX_GAP_S or more after the one before."""
        assert self.done == {}, f"the bystander ended during the flood: {self.done}"
        assert stack.api.post(f"/v1/jobs/{self.job_id}/cancel").status_code == 202
        job = stack.api.wait_job(self.job_id)
        assert job["status"] == "cancelled", job
        # The reader, a thread of this process, may not have read the last tokens yet.
        wait_until(lambda: self.done, 30, "the bystander's stream to end")
        assert "".join(self.texts) == job["output"]["text"]
        assert len(self.texts) == job["usage"]["completion_tokens"]
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]
        assert max(gaps) < MAX_GAP_S, f"a token came {max(gaps):.2f}s after the one before"


# A bystander's length: it must outlast any flood on any machine (CI's flood at the door
# outlasted 4,000 tokens, 7 s of the tiny model), so it is cancelled once the flood has ended.
UNENDING = 100_000


@pytest.fixture
def bystander(stack: Stack, tiny_model: Path) -> Iterator[Stream]:
    """A job streaming beside the flood, from before it starts until after it ends; submitted
    through an API whose EXO_MAX_TOKENS lets it run until cancelled."""
    with serving(api_settings(stack.redis.url, [tiny_model], max_tokens=UNENDING)) as unending:
        job_id = unending.submit(prompt="bystander", max_tokens=UNENDING, ignore_eos=True)
    stream = Stream(stack.api, job_id)
    reader = threading.Thread(target=stream.read, daemon=True)
    reader.start()
    wait_until(lambda: len(stream.arrivals) >= 5, 30, "the bystander's first tokens")
    yield stream
    stack.api.post(f"/v1/jobs/{job_id}/cancel")  # a test that failed before unharmed()
    reader.join(60)
    assert not reader.is_alive(), "the bystander's stream never ended"


@pytest.fixture
def blind_api(stack: Stack, tmp_path: Path) -> Iterator[Api]:
    """An API that serves the stack's model but cannot read its tokenizer (its copy of the
    model's directory is empty): every prompt passes its door, as for a hub model this host
    never downloaded."""
    with serving(api_settings(stack.redis.url, [tmp_path / "tiny"])) as api:
        yield api


def flood(api: Api, count: int) -> list[requests.Response]:
    def post(_: int) -> requests.Response:
        return requests.post(f"{api.url}/v1/jobs", json={"prompt": OVER_LONG}, timeout=60)

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(post, range(count)))


def unchanged(before: RunnerState, after: RunnerState) -> None:
    assert (after.pid, after.restarts) == (before.pid, before.restarts), after
    assert after.status.accepts_jobs, after


def test_a_flood_the_runner_refuses_harms_no_other_job(
    stack: Stack, blind_api: Api, bystander: Stream
) -> None:
    """Today's failure: the runner refused them one after another without stepping its batch,
    the watchdog killed it after 5 s and the bystander failed with it."""
    before = runner_state(stack.store, "host-a")
    accepted = flood(blind_api, FLOOD)
    assert [r.status_code for r in accepted] == [202] * FLOOD
    for response in accepted:
        job = stack.api.wait_job(response.json()["id"], timeout_s=60)
        assert job["status"] == "failed", job
        assert job["error"].startswith("prompt: is at least ") and CAP_ERROR in job["error"]
    bystander.unharmed(stack)
    unchanged(before, runner_state(stack.store, "host-a"))


# --- the door: refused before anything is stored or streamed ---

ROUTES = [
    ("/v1/jobs", {"prompt": OVER_LONG}, "prompt"),
    ("/v1/jobs", {"messages": [{"role": "user", "content": OVER_LONG}]}, "messages"),
    ("/v1/completions", {"model": "tiny", "prompt": OVER_LONG}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": OVER_LONG, "stream": True}, "prompt"),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": OVER_LONG}]},
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": OVER_LONG}], "stream": True},
        "messages",
    ),
]


@pytest.mark.parametrize(("path", "body", "field"), ROUTES)
def test_the_door_refuses_an_over_long_prompt_naming_the_field_and_the_limit(
    stack: Stack, path: str, body: dict[str, Any], field: str
) -> None:
    before = stack.store.redis.zcard("exo:jobs")
    response = requests.post(stack.api.url + path, json=body, timeout=30, stream=True)
    assert response.headers["Content-Type"] == "application/json", "a stream was opened"
    error = response.json()["error"]
    # One token per character (the tiny model's); a message's two ends are not counted.
    tokens = 99_990 if field == "prompt" else 99_990 - 4
    message = f"{field}: is at least {tokens} tokens with the model's tokenizer; {CAP_ERROR}"
    if path == "/v1/jobs":
        assert response.status_code == 422
        assert error["message"] == message
        assert error["details"] == [
            {
                "field": field,
                "message": message.removeprefix(f"{field}: "),
                "tokens": tokens,
                "limit": 8192,
            }
        ]
    else:  # OpenAI's shape
        assert response.status_code == 400
        assert error["message"] == message and error["param"] == field
    assert stack.store.redis.zcard("exo:jobs") == before, "a job was stored"


PAST_THE_VOCABULARY = [  # the tiny model's vocabulary is 99 tokens
    ("/v1/jobs", {"prompt": "hi", "temperature": 1, "top_k": 99}, "top_k"),
    ("/v1/jobs", {"prompt": "hi", "logit_bias": {"7": 1, "500": 1}}, "logit_bias"),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_k": 1000},
        "top_k",
    ),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"99": 5}}, "logit_bias"),
]


@pytest.mark.parametrize(("path", "body", "field"), PAST_THE_VOCABULARY)
def test_the_door_refuses_sampling_past_the_vocabulary_naming_the_field(
    stack: Stack, path: str, body: dict[str, Any], field: str
) -> None:
    """The runner refuses them too (its sampler would raise for the whole batch); refused
    there, the OpenAI routes answered a 500 for the client's own input (found by schemathesis)."""
    before = stack.store.redis.zcard("exo:jobs")
    response = requests.post(stack.api.url + path, json=body, timeout=30)
    error = response.json()["error"]
    assert error["message"].startswith(f"{field}: ") and "vocabulary" in error["message"]
    if path == "/v1/jobs":
        assert response.status_code == 422 and error["details"][0]["field"] == field
    else:  # OpenAI's shape
        assert response.status_code == 400 and error["param"] == field
    assert stack.store.redis.zcard("exo:jobs") == before, "a job was stored"


@pytest.mark.parametrize("stream", [False, True])
def test_what_the_runner_refuses_for_the_clients_input_is_a_400_on_the_openai_routes(
    stack: Stack, blind_api: Api, stream: bool
) -> None:
    """Past a door that cannot read the tokenizer the runner refuses the job: it fails as
    refused, and the OpenAI routes answer the client's error, not a 500 runner_gone."""
    chat = [{"role": "user", "content": "hi"}]
    body = {"model": "tiny", "messages": chat, "temperature": 1, "top_k": 99, "stream": stream}
    response = requests.post(f"{blind_api.url}/v1/chat/completions", json=body, timeout=60)
    if stream:  # the stream had opened: its last chunk before [DONE] is the error
        assert response.status_code == 200
        chunks = [line for line in response.text.splitlines() if line.startswith("data: {")]
        error = json.loads(chunks[-1].removeprefix("data: "))["error"]
    else:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
    assert error["type"] == "invalid_request_error", error
    assert error["code"] == "invalid_request" and error["message"].startswith("top_k: "), error
    [newest] = stack.api.get("/v1/jobs?limit=1").json()
    job = stack.api.get(f"/v1/jobs/{newest['id']}").json()
    assert job["status"] == "failed" and job["refused"] is True, job


def test_a_flood_at_the_door_is_refused_there_beside_a_stream(
    stack: Stack, bystander: Stream
) -> None:
    before = runner_state(stack.store, "host-a")
    jobs_before = stack.store.redis.zcard("exo:jobs")
    refused = flood(stack.api, FLOOD)
    assert [r.status_code for r in refused] == [422] * FLOOD
    assert all(CAP_ERROR in r.json()["error"]["message"] for r in refused)
    assert stack.store.redis.zcard("exo:jobs") == jobs_before
    bystander.unharmed(stack)
    unchanged(before, runner_state(stack.store, "host-a"))
