"""The OpenAI-compatible routes, driven by the official `openai` client through the real queue."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types import Completion

from tests.support.clients import CHAT, HOST_A, client_for, job_of
from tests.support.processes import Processes, wait_until
from tests.support.stack import Stack, new_worker, wait_tokens


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with client_for(stack.api) as client:
        yield client


def greedy_chat(**fields: Any) -> dict[str, Any]:
    """Arguments for `chat.completions.create`: greedy, on the session host."""
    return {"model": "tiny", "messages": CHAT, "temperature": 0, "extra_body": HOST_A, **fields}


def test_chat_completion_is_a_job_through_the_queue(stack: Stack, client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(**greedy_chat(max_tokens=24))
    assert completion.object == "chat.completion" and completion.id.startswith("chatcmpl-")
    assert completion.model == "tiny" and abs(completion.created - time.time()) < 60
    (choice,) = completion.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    job = job_of(stack.api, completion.id)
    assert job["status"] == "succeeded" and job["runner_id"] == "tiny@host-a"
    assert choice.message.content == job["output"]["text"] and len(job["output"]["text"]) > 0
    usage = completion.usage
    assert usage is not None and usage.completion_tokens == 24
    assert job["usage"] == {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
    }
    native = stack.api.wait_job(stack.api.submit(messages=CHAT, max_tokens=24, **HOST_A))
    assert native["output"]["text"] == choice.message.content


def test_streamed_chat_equals_the_non_streamed_text(stack: Stack, client: openai.OpenAI) -> None:
    request = greedy_chat(max_completion_tokens=40)
    whole = client.chat.completions.create(**request)
    chunks = list(
        client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and len(text) > 0
    assert len(chunks) >= 40  # a chunk per token, not one block at the end
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"


def test_completions_stream_and_not(stack: Stack, client: openai.OpenAI) -> None:
    prompt = "The quick brown fox"
    whole = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=32, temperature=0, extra_body=HOST_A
    )
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.choices[0].finish_reason == "length"
    native = stack.api.wait_job(stack.api.submit(prompt=prompt, max_tokens=32, **HOST_A))
    assert whole.choices[0].text == native["output"]["text"] and len(native["output"]["text"]) > 0
    chunks = list(
        client.completions.create(
            model="tiny", prompt=[prompt], max_tokens=32, stream=True, extra_body=HOST_A
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len(chunks) >= 32
    default = client.completions.create(model="tiny", prompt=prompt, extra_body=HOST_A)
    assert default.usage is not None and default.usage.completion_tokens == 16  # OpenAI's default


def test_stop_strings_cut_the_output_stream_and_not(stack: Stack, client: openai.OpenAI) -> None:
    request = greedy_chat(max_tokens=40)
    free = client.chat.completions.create(**request).choices[0].message.content
    assert free is not None
    stop = free[12:14]
    expected = free.split(stop)[0]
    assert len(expected) <= 12
    cut = client.chat.completions.create(**request, stop=stop).choices[0]
    assert cut.message.content == expected and cut.finish_reason == "stop"
    chunks = list(client.chat.completions.create(**request, stop=[stop, "~~~~"], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    text_cut = client.completions.create(
        model="tiny", prompt="hello", max_tokens=40, stop=[stop], extra_body=HOST_A
    )
    assert stop not in text_cut.choices[0].text


def test_seed_reproduces_sampled_text(client: openai.OpenAI) -> None:
    def sampled(seed: int) -> str:
        completion = client.completions.create(
            model="tiny",
            prompt="dice",
            max_tokens=24,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True, **HOST_A},
        )
        return completion.choices[0].text

    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)


def test_each_job_keeps_its_own_sampling_inside_one_batch(
    stack: Stack, client: openai.OpenAI
) -> None:
    settings: list[dict[str, Any]] = [
        {"temperature": 0},
        {"temperature": 1.0, "seed": 11},
        {"temperature": 0.7, "top_p": 0.5, "seed": 12},
        {"temperature": 1.3, "top_p": 0.9, "seed": 13},
    ]

    def run(setting: dict[str, Any]) -> Completion:
        completion: Completion = client.completions.create(
            model="tiny",
            prompt="Once upon a time",
            # Long enough to overlap however the four requests spread: 300 tokens each ended
            # before the last one started, beside two busy loops.
            max_tokens=900,
            extra_body={"ignore_eos": True, **HOST_A},
            **setting,
        )
        return completion

    alone = [run(setting).choices[0].text for setting in settings]
    assert len(set(alone)) == len(settings)  # the settings really differ
    with ThreadPoolExecutor(len(settings)) as pool:
        together = list(pool.map(run, settings))
    assert [c.choices[0].text for c in together] == alone
    jobs = [job_of(stack.api, c.id) for c in together]
    # They shared the batch: every job started before any of them finished.
    assert max(j["started_at"] for j in jobs) < min(j["finished_at"] for j in jobs)


def test_models_lists_what_live_runners_serve_with_their_hosts(
    stack: Stack, client: openai.OpenAI
) -> None:
    models = {m.id: m for m in client.models.list()}
    assert "tiny" in models
    tiny = models["tiny"]
    assert tiny.object == "model" and tiny.owned_by == "exo_tasks"
    assert "host-a" in (tiny.model_extra or {})["hosts"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("gpt-9")
    assert_openai_error(raised.value, 404, "model", "model_not_found")


def assert_openai_error(
    error: openai.APIStatusError, status: int, param: str | None, code: str
) -> None:
    body = error.body
    assert isinstance(body, dict), body
    assert error.status_code == status
    assert body["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert body["param"] == param and body["code"] == code and body["message"], body


def test_an_unknown_model_is_404_in_openai_shape(stack: Stack, client: openai.OpenAI) -> None:
    before = stack.store.redis.zcard("exo:jobs")
    with pytest.raises(openai.NotFoundError) as chat:
        client.chat.completions.create(model="gpt-9", messages=CHAT)
    with pytest.raises(openai.NotFoundError) as text:
        client.completions.create(model="gpt-9", prompt="hi")
    for raised in (chat, text):
        assert_openai_error(raised.value, 404, "model", "model_not_found")
        assert "gpt-9" in raised.value.message and "tiny" in raised.value.message
    assert stack.store.redis.zcard("exo:jobs") == before


BAD_FIELDS: list[tuple[str, dict[str, Any], str, str]] = [
    ("chat", {"n": 2}, "n", "invalid_value"),
    # The tiny model's chat template takes no tools.
    (
        "chat",
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        "tools",
        "invalid_request",
    ),
    ("chat", {"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "invalid_value"),  # without logprobs
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ("chat", {"presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
    ("chat", {"logit_bias": {"x": 1}}, "logit_bias.x.[key]", "invalid_value"),
    ("chat", {"logit_bias": {"5": 101}}, "logit_bias.5", "invalid_value"),
    ("chat", {"top_k": -1}, "top_k", "invalid_value"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format.type", "invalid_value"),
    ("chat", {"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ("chat", {"temperature": 2.5}, "temperature", "invalid_value"),
    ("chat", {"top_p": 0}, "top_p", "invalid_value"),
    ("chat", {"max_tokens": 0}, "max_tokens", "invalid_value"),
    ("chat", {"max_completion_tokens": 5000}, "max_completion_tokens", "invalid_value"),
    (
        "chat",
        {"max_tokens": 8, "max_completion_tokens": 8},
        "max_completion_tokens",
        "invalid_value",
    ),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "invalid_value"),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages.0.content",
        "invalid_value",
    ),
    (
        "chat",
        {"messages": [{"role": "user", "content": "x", "audio": {}}]},
        "messages.0.audio",
        "unsupported_parameter",
    ),
    ("completions", {"prompt": ["a", "b"]}, "prompt", "invalid_value"),
    ("completions", {"echo": True}, "echo", "invalid_value"),
    ("completions", {"suffix": "!"}, "suffix", "unsupported_parameter"),
    ("completions", {"logprobs": 21}, "logprobs", "invalid_value"),
]


@pytest.mark.parametrize(("route", "fields", "param", "code"), BAD_FIELDS)
def test_unsupported_or_invalid_fields_are_400_naming_the_field(
    stack: Stack, client: openai.OpenAI, route: str, fields: dict[str, Any], param: str, code: str
) -> None:
    before = stack.store.redis.zcard("exo:jobs")
    with pytest.raises(openai.BadRequestError) as raised:
        if route == "chat":
            client.chat.completions.create(model="tiny", messages=CHAT, extra_body=fields)
        else:
            client.completions.create(model="tiny", prompt="hi", extra_body=fields)
    assert_openai_error(raised.value, 400, param, code)
    assert param.split(".")[0] in raised.value.message
    assert stack.store.redis.zcard("exo:jobs") == before  # nothing was enqueued


def test_only_the_openai_routes_use_the_openai_error_shape(stack: Stack) -> None:
    wrong_method = stack.api.get("/v1/chat/completions")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    assert wrong_method.json()["error"]["code"] == "method_not_allowed"
    native = stack.api.post("/v1/jobs", json={"prompt": "a", "n": 2})
    assert native.status_code == 422
    assert set(native.json()["error"]) == {"type", "message", "details"}
    assert native.json()["error"]["message"] == "n: not supported"


def test_a_failed_job_is_an_openai_error_streamed_or_not(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    new_worker(stack, processes, tiny_model, tmp_path, "oa-fail")
    request: dict[str, Any] = {
        "model": "tiny",
        "messages": CHAT,
        "max_tokens": 4000,
        "extra_body": {"host": "oa-fail", "ignore_eos": True},
    }
    client = client_for(stack.api)
    errors: list[openai.APIStatusError] = []

    def whole() -> None:
        try:
            client.chat.completions.create(**request)
        except openai.APIStatusError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=whole, daemon=True)
    waiter.start()
    stream = client.chat.completions.create(**request, stream=True)
    wait_tokens(stack, stream.response.headers["x-exo-job-id"])
    wait_until(
        lambda: stack.api.get("/v1/runners/tiny@oa-fail").json()["active_jobs"] == 2,
        10,
        "both jobs running",
    )
    stack.api.post("/v1/runners/tiny@oa-fail/shutdown", json={"mode": "hard"})
    with pytest.raises(openai.APIError) as streamed:
        for _ in stream:
            pass
    assert "shut down" in streamed.value.message
    waiter.join(timeout=5)
    (error,) = errors
    assert_openai_error(error, 500, None, "runner_gone")
    assert "shut down" in error.message


def test_a_stream_whose_job_is_requeued_midway_ends_in_an_error_and_cancels_the_job(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    new_worker(stack, processes, tiny_model, tmp_path, "oa-requeue")
    stream = client_for(stack.api).completions.create(
        model="tiny",
        prompt="requeue me",
        max_tokens=4000,
        stream=True,
        extra_body={"host": "oa-requeue", "ignore_eos": True},
    )
    job_id = stream.response.headers["x-exo-job-id"]
    text = "".join(next(stream).choices[0].text for _ in range(10))
    response = stack.api.post("/v1/hosts/oa-requeue/shutdown", json={"mode": "cold"})
    assert response.status_code == 202
    with pytest.raises(openai.APIError) as raised:
        for chunk in stream:
            text += chunk.choices[0].text
    assert "requeued" in raised.value.message and len(text) >= 10
    job = stack.api.wait_job(job_id, timeout_s=5)
    assert job["status"] == "cancelled" and job["attempts"] == 1  # nobody reads a second try
