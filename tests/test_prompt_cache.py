"""The runner's prompt cache inside the batching engine, on the real `chat` model: greedy text is
the same with the cache on and off, jobs reuse shared prefixes (a system prompt, a resent
conversation), the bytes stay under the bound, and a new engine starts cold."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx_lm
import pytest

from exo_tasks.runner.engine import BatchEngine
from exo_tasks.runner.lane import HOLD_MIN_TOKENS
from exo_tasks.runner.prompt_cache import PromptCache
from exo_tasks.types import SamplingParams

SYSTEM = "You are a terse assistant who answers in one line, 世界 😀 café. " * 12


@pytest.fixture(scope="module")
def loaded(chat_model: Path) -> tuple[Any, Any]:
    loaded = mlx_lm.load(str(chat_model))
    return loaded[0], loaded[1]


def chat(tokenizer: Any, *turns: str) -> list[int]:
    """A conversation with the shared system prompt: user, assistant, user, ..."""
    messages = [{"role": "system", "content": SYSTEM}]
    roles = ["user", "assistant"]
    messages += [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def run(engine: BatchEngine, jobs: dict[str, list[int]], max_tokens: int = 16) -> dict[str, Any]:
    """Run jobs added together to their end: each one's text and cached tokens."""
    params = SamplingParams.model_validate({"max_tokens": max_tokens})
    for job_id, tokens in jobs.items():
        engine.add(job_id, tokens, params)
    text = dict.fromkeys(jobs, "")
    cached: dict[str, int] = {}
    while engine.active_jobs:
        for delta in engine.step():
            assert delta.error is None, delta.error
            text[delta.job_id] += delta.text
            if delta.cached_tokens is not None:
                cached[delta.job_id] = delta.cached_tokens
    return {"text": text, "cached": cached}


@pytest.mark.parametrize("lanes", [1, 2])
def test_greedy_text_is_the_same_with_the_cache_on_and_off(
    loaded: tuple[Any, Any], lanes: int
) -> None:
    _, tokenizer = loaded
    shared = {f"user-{i}": chat(tokenizer, f"question {i}: 你好 {'x' * i}") for i in range(12)}
    results = {}
    for cache_bytes in (0, 64 << 20):
        engine = BatchEngine(*loaded, lanes=lanes, prompt_cache_bytes=cache_bytes)
        try:
            first = run(engine, shared)
            # A conversation resent with each turn, after the first batch.
            history: list[str] = []
            turns = {}
            for turn in range(4):
                history.append(f"turn {turn} ñ 😀")
                tokens = chat(tokenizer, *history)
                turns[f"turn-{turn}"] = tokens
                step = run(engine, {f"turn-{turn}": tokens})
                first["text"] |= step["text"]
                first["cached"] |= step["cached"]
                history.append(step["text"][f"turn-{turn}"])
            results[cache_bytes] = first
        finally:
            engine.close()
    off, on = results[0], results[64 << 20]
    assert on["text"] == off["text"]
    assert set(off["cached"].values()) == {0}
    # Sent together: one job prefills the system prompt, the others wait for it and reuse it.
    system_tokens = len(chat(tokenizer)) - 4
    hits = sorted(on["cached"][f"user-{i}"] for i in range(12))
    assert hits[0] == 0 and hits[1] >= system_tokens, hits
    # Each turn reuses the whole previous conversation (prompt and answer).
    for turn in range(1, 4):
        previous = len(turns[f"turn-{turn - 1}"])
        assert on["cached"][f"turn-{turn}"] >= previous, (turn, on["cached"])


def test_a_repeated_prompt_reuses_all_but_its_last_token(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    engine = BatchEngine(*loaded, lanes=1, prompt_cache_bytes=64 << 20)
    try:
        engine.warmup()
        assert engine.prompt_cache_bytes == 0  # warming up leaves nothing behind
        tokens = chat(tokenizer, "again and again 再来")
        once = run(engine, {"a": tokens}, max_tokens=12)
        twice = run(engine, {"b": tokens}, max_tokens=12)
        assert once["cached"]["a"] == 0 and twice["cached"]["b"] == len(tokens) - 1
        assert once["text"]["a"] == twice["text"]["b"]
        assert twice["text"]["b"] == mlx_lm.generate(model, tokenizer, tokens, max_tokens=12)
        assert engine.prompt_cache_bytes > 0
    finally:
        engine.close()
    # A runner restart is a new engine: it starts cold.
    fresh = BatchEngine(*loaded, lanes=1, prompt_cache_bytes=64 << 20)
    try:
        assert fresh.prompt_cache_bytes == 0
        assert run(fresh, {"c": tokens}, max_tokens=12)["cached"]["c"] == 0
    finally:
        fresh.close()


def test_nothing_is_shared_across_models(loaded: tuple[Any, Any], tiny_model: Path) -> None:
    tiny = mlx_lm.load(str(tiny_model))
    chat_engine = BatchEngine(*loaded, lanes=1, prompt_cache_bytes=64 << 20)
    tiny_engine = BatchEngine(tiny[0], tiny[1], lanes=1, prompt_cache_bytes=64 << 20)
    try:
        prompt = "the same words on both models " * 4
        for engine in (chat_engine, tiny_engine):
            tokens = engine.encode(prompt, None)
            assert run(engine, {"x": tokens})["cached"]["x"] == 0
            assert run(engine, {"y": tokens})["cached"]["y"] == len(tokens) - 1
    finally:
        chat_engine.close()
        tiny_engine.close()


def test_eviction_keeps_the_bytes_under_the_bound(tiny_model: Path) -> None:
    # On `tiny`, whose prefill is cheapest (a vocabulary of 100): the cache does not care.
    model, tokenizer = mlx_lm.load(str(tiny_model))[:2]
    bound = 2 << 20
    engine = BatchEngine(model, tokenizer, lanes=1, prompt_cache_bytes=bound)
    cache: PromptCache = engine.prompt_cache
    highest = 0
    try:
        # 240 distinct prompts of 300 tokens each: 150 KiB of KV state each, 36 MB in all.
        for batch in range(30):
            jobs = {
                f"{batch}-{i}": engine.encode(f"{batch:02}-{i} " + "distinct words " * 20, None)
                for i in range(8)
            }
            run(engine, jobs, max_tokens=1)
            measured = sum(c.nbytes for entry in _entries(cache) for c in entry)
            assert measured == cache.nbytes <= bound
            highest = max(highest, measured)
        assert len(cache) >= 2 and highest > bound // 2  # it keeps what fits
    finally:
        engine.close()


def _entries(cache: PromptCache) -> list[list[Any]]:
    """Every KV state the cache holds, measured apart from its own byte count."""
    found: list[list[Any]] = []
    stack = [cache._lru._trie._trie]
    while stack:
        node = stack.pop()
        for key, child in node.items():
            if key == "__value__":
                found.append(child.prompt_cache)
            else:
                stack.append(child)
    return found


def test_a_job_waits_only_for_a_prefix_worth_waiting_for() -> None:
    from exo_tasks.runner.lane import LaneJob

    def job(prompt: list[int], cached: int = 0) -> LaneJob:
        made = LaneJob("j", prompt, {}, None, [], None, None, None)
        made.cached_tokens = cached
        return made

    base = list(range(100))
    assert job([*base, 1]).awaits([job([*base, 2])])
    assert not job([*base, 1]).awaits([job([*base, 2], cached=100 - HOLD_MIN_TOKENS + 1)])
    assert not job([7, *base]).awaits([job(base)])
    assert not job(base[:10]).awaits([job(base)])
