"""On the `chat` preset (byte-level BPE, ChatML), every path gives mlx-lm's own text: a job's
text and its SSE token events, /v1/completions and /v1/chat/completions, streamed or not, equal
`mlx_lm.generate` on the same prompt (greedy), with mlx-lm's token counts; no event carries a
broken character; the prompt cache shows in usage, /metrics and GET /v1/runners."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx_lm
import openai
import pytest

from exo_tasks.bpe import IM_END
from tests.support import sse
from tests.support.api import Api, api_settings, serving
from tests.support.clients import client_for
from tests.support.metrics import scrape, value
from tests.support.processes import Processes
from tests.support.workers import new_worker

BASE = [
    "hello there",
    "The quick brown fox jumps over the lazy dog",
    "世界你好",
    "今天天气很好\uff0c我们去公园吧",
    "日本語のテキスト",
    "emoji 😀🎉🚀 party",
    "👩‍👩‍👧 family 🏳️‍🌈",
    "café résumé naïve",
    "Ångström über façade",
    "e\u0301 a\u0300 o\u0302 combining",
    "Zalgo: a\u0301\u0302\u0303b\u0308\u0327",
    "mixed 混合 text ✨ avec des accents à la fin",
    "1 2 3 4 5",
    "<tag> & \"quotes\" 'single'",
    "tabs\tand\nnew lines",
    "kaer thethe ingon",
    "ñandú pingüino 🐧",
    "한국어 텍스트",
    "Ελληνικά κείμενο",
    "Русский текст",
    "a" * 7 + " 世" * 3 + " 😀" * 3,
]
LONG = ("Lorem ipsum dolor sit amet, 世界 😀 café. " * 60)[:2000]
PROMPTS = [*BASE, LONG]
MAX_TOKENS = 24


@dataclass
class Reference:
    """mlx-lm's own greedy generation on a prompt."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    segments: list[str]


@dataclass
class ChatHost:
    api: Api
    client: openai.OpenAI
    model: Any
    tokenizer: Any

    def reference(self, tokens: list[int], max_tokens: int = MAX_TOKENS) -> Reference:
        responses = list(
            mlx_lm.stream_generate(self.model, self.tokenizer, tokens, max_tokens=max_tokens)
        )
        text = mlx_lm.generate(self.model, self.tokenizer, tokens, max_tokens=max_tokens)
        assert text == "".join(r.text for r in responses)
        last = responses[-1]
        reason = str(last.finish_reason)
        return Reference(
            text, len(tokens), last.generation_tokens, reason, [r.text for r in responses]
        )

    def chat_tokens(self, prompt: str) -> list[int]:
        messages = [{"role": "user", "content": prompt}]
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


@pytest.fixture(scope="module")
def host(
    redis_server: Any, store: Any, chat_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ChatHost]:
    processes = Processes()
    try:
        data_dir = tmp_path_factory.mktemp("chat-host")
        new_worker(processes, redis_server.url, store, "chat-host", [chat_model], data_dir)
        model, tokenizer = mlx_lm.load(str(chat_model))[:2]
        settings = api_settings(redis_server.url, [chat_model])
        with serving(settings) as api, client_for(api) as client:
            yield ChatHost(api, client, model, tokenizer)
    finally:
        processes.stop_all()


def job_and_events(api: Api, **body: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    job_id = api.submit(model="chat", temperature=0, **body)
    events = sse.parse(api.get(f"/v1/jobs/{job_id}/stream").text)
    return api.wait_job(job_id), events


def check_events(events: list[dict[str, Any]], text: str) -> None:
    tokens = [e["data"]["text"] for e in events if e["event"] == "token"]
    assert events[-1]["event"] == "done"
    assert all("\ufffd" not in t for t in tokens)
    assert "".join(tokens) == text


def check_usage(usage: Any, ref: Reference) -> None:
    assert usage.prompt_tokens == ref.prompt_tokens
    assert usage.completion_tokens == ref.completion_tokens
    assert usage.total_tokens == ref.prompt_tokens + ref.completion_tokens


def completions_match(host: ChatHost, prompt: str) -> None:
    ref = host.reference(list(host.tokenizer.encode(prompt)))
    job, events = job_and_events(host.api, prompt=prompt, max_tokens=MAX_TOKENS)
    assert job["output"]["text"] == ref.text, prompt
    assert job["output"]["finish_reason"] == ref.finish_reason
    assert job["usage"]["prompt_tokens"] == ref.prompt_tokens
    assert job["usage"]["completion_tokens"] == ref.completion_tokens
    check_events(events, ref.text)
    request: dict[str, Any] = {
        "model": "chat",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    whole = host.client.completions.create(**request)
    assert whole.choices[0].text == ref.text and whole.choices[0].finish_reason == ref.finish_reason
    check_usage(whole.usage, ref)
    chunks = list(
        host.client.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
    )
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == ref.text
    check_usage(chunks[-1].usage, ref)


def chat_matches(host: ChatHost, prompt: str) -> Reference:
    ref = host.reference(host.chat_tokens(prompt))
    messages = [{"role": "user", "content": prompt}]
    job, events = job_and_events(host.api, messages=messages, max_tokens=MAX_TOKENS)
    assert job["output"]["text"] == ref.text, prompt
    assert job["usage"]["completion_tokens"] == ref.completion_tokens
    check_events(events, ref.text)
    request: dict[str, Any] = {
        "model": "chat",
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    whole = host.client.chat.completions.create(**request)
    choice = whole.choices[0]
    assert choice.message.content == ref.text and choice.finish_reason == ref.finish_reason
    assert IM_END not in ref.text
    check_usage(whole.usage, ref)
    chunks = list(
        host.client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
    )
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == ref.text
    check_usage(chunks[-1].usage, ref)
    return ref


def test_every_path_gives_mlx_lm_text_and_counts(host: ChatHost) -> None:
    assert len(PROMPTS) >= 20 and len(LONG) == 2000
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: completions_match(host, p), PROMPTS))
        refs = list(pool.map(lambda p: chat_matches(host, p), PROMPTS))
    # Some answers end by themselves: <|im_end|> is the EOS, stop, and never text.
    assert any(ref.finish_reason == "stop" for ref in refs)
    assert any(ref.finish_reason == "length" for ref in refs)
    joined = "".join(ref.text for ref in refs)
    assert any(ord(c) > 0x3000 for c in joined)  # the answers have CJK or emoji in them


def stop_across_tokens(ref: Reference) -> str | None:
    """The last character of one token's text and the first two of the next one's, one of
    them not ASCII if possible; None if the text has no such pair."""
    pairs = [
        ref.segments[i][-1] + ref.segments[i + 1][:2]
        for i in range(2, len(ref.segments) - 1)
        if ref.segments[i] and len(ref.segments[i + 1]) >= 2
    ]
    pairs.sort(key=lambda s: s.isascii())
    return pairs[0] if pairs else None


def test_a_stop_string_across_tokens_cuts_exactly_before_it(host: ChatHost) -> None:
    for prompt in PROMPTS:
        ref = host.reference(host.chat_tokens(prompt), max_tokens=48)
        stop = stop_across_tokens(ref)
        if stop is not None:
            break
    assert stop is not None
    expected = ref.text[: ref.text.find(stop)]
    messages = [{"role": "user", "content": prompt}]
    job, events = job_and_events(host.api, messages=messages, max_tokens=48, stop=[stop])
    assert job["output"]["text"] == expected and job["output"]["finish_reason"] == "stop"
    check_events(events, expected)


def test_the_prompt_cache_shows_in_usage_metrics_and_runners(host: ChatHost) -> None:
    before = scrape(host.api.url)
    messages = [
        {"role": "system", "content": "You answer in one line. " * 20},
        {"role": "user", "content": "世界 cache me 😀"},
    ]
    request: dict[str, Any] = {"model": "chat", "messages": messages, "max_tokens": 8}
    first = host.client.chat.completions.create(**request, temperature=0)
    second = host.client.chat.completions.create(**request, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert first.choices[0].message.content == second.choices[0].message.content
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == second.usage.prompt_tokens - 1
    job = host.api.get(f"/v1/jobs/{second.id.split('-', 1)[1]}").json()
    assert job["usage"]["prompt_tokens_details"]["cached_tokens"] == details.cached_tokens
    after = scrape(host.api.url)

    def grew(name: str) -> float:
        return value(after, name, model="chat") - value(before, name, model="chat")

    assert grew("exo_prefix_cache_queries_total") >= 2 * second.usage.prompt_tokens
    assert grew("exo_prefix_cache_hits_total") >= details.cached_tokens
    # This module's host's runner (other modules' hosts may have served chat on this Redis).
    runner = host.api.get("/v1/runners/chat@chat-host").json()
    assert runner["prompt_cache_bytes"] > 0
