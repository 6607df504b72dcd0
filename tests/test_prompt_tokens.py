"""The count the API's door and the runner's intake refuse prompts by is a lower bound of the
runner's exact one (mlx-lm's tokenizer, after the chat template): what they refuse is over the
cap for certain."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import load as load_tokenizer

from exo_tasks import prompt_tokens
from exo_tasks.api.prompt_door import COUNTING_THREADS, _offloader
from exo_tasks.types import ChatMessage

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=300)


@pytest.mark.parametrize("preset", ["tiny", "chat"])
def test_the_count_never_exceeds_the_runners(
    preset: str, tiny_model: Path, chat_model: Path
) -> None:
    model = tiny_model if preset == "tiny" else chat_model
    exact: Any = load_tokenizer(model)
    tokenizer = prompt_tokens.load(str(model))
    assert tokenizer is not None

    @settings(max_examples=150, deadline=None)
    @given(
        TEXT.filter(bool),
        st.lists(st.tuples(st.sampled_from(["user", "system"]), TEXT), min_size=1, max_size=4),
    )
    def lower_bound(prompt: str, chat: list[tuple[str, str]]) -> None:
        assert prompt_tokens.at_least(tokenizer, prompt, None) <= len(exact.encode(prompt))
        messages = [ChatMessage(role=role, content=content) for role, content in chat]  # type: ignore[arg-type]
        rendered = exact.apply_chat_template(
            [m.model_dump(include={"role", "content"}) for m in messages],
            add_generation_prompt=True,
        )
        assert prompt_tokens.at_least(tokenizer, None, messages) <= len(rendered)

    lower_bound()


def test_over_the_cap_for_certain_names_the_field_and_the_limit(tiny_model: Path) -> None:
    tokenizer = prompt_tokens.load(str(tiny_model))
    assert tokenizer is not None
    prompt_tokens.check(tokenizer, "x" * 100, None, cap=100)
    with pytest.raises(prompt_tokens.PromptTooLong) as over:
        prompt_tokens.check(tokenizer, "x" * 101, None, cap=100)
    assert (over.value.field, over.value.tokens) == ("prompt", 101)
    assert str(over.value) == (
        "is at least 101 tokens with the model's tokenizer; at most 100 (EXO_MAX_PROMPT_TOKENS)"
    )


def test_a_model_without_a_tokenizer_file_is_left_to_the_runner(tmp_path: Path) -> None:
    assert prompt_tokens.load(str(tmp_path)) is None
    assert prompt_tokens.load("no-such-org/no-such-model") is None


GEVENT_COUNT = """
from gevent import monkey

monkey.patch_all()
import sys, time
import gevent
from exo_tasks import prompt_tokens
from exo_tasks.api.prompt_door import _offloader

tokenizer = prompt_tokens.load(sys.argv[1])
offload = _offloader()
ticks = []

def tick():
    while True:
        ticks.append(time.monotonic())
        gevent.sleep(0.001)

ticker = gevent.spawn(tick)
gevent.sleep(0.01)
started = time.monotonic()
tokens = offload(prompt_tokens.at_least, tokenizer, "p" * 100_000, None)
took = time.monotonic() - started
during = [t for t in ticks if started <= t <= started + took]
print(tokens, round(took * 1000), len(during))
"""


def test_under_gevent_a_long_prompt_is_counted_while_the_hub_serves_others(
    chat_model: Path,
) -> None:
    """Counted in the greenlet itself, 100,000 characters held the API process's every
    connection for 20-40 ms; on the door's real thread, the hub goes on meanwhile."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", GEVENT_COUNT, str(chat_model)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    tokens, took_ms, ticks = (int(x) for x in out)
    assert tokens > 8192
    # A tick each millisecond or so while the count ran: the hub was free (a blocked hub
    # ticks once at most).
    assert ticks >= max(3, took_ms // 10), (took_ms, ticks)


def test_under_a_threaded_server_long_prompts_are_counted_one_at_a_time() -> None:
    """Counted in each request's own thread, a flood of long prompts counted on every core at
    once, starving the streams beside it (tests/chaos/test_prompt_flood.py)."""
    counting = 0
    most = 0
    lock = threading.Lock()

    def count() -> None:
        nonlocal counting, most
        with lock:
            counting += 1
            most = max(most, counting)
        time.sleep(0.02)
        with lock:
            counting -= 1

    offload = _offloader()
    with ThreadPoolExecutor(8) as requests:
        for future in [requests.submit(offload, count) for _ in range(16)]:
            future.result()
    assert most == COUNTING_THREADS == 1
