"""exo_tasks.prefix_routing's pure parts: which prefixes a prompt names, and when a host can
take a job its prefix prefers. The routing itself, on real hosts: tests/test_fleet.py."""

from __future__ import annotations

from typing import Any

from exo_tasks.fleet import Fleet
from exo_tasks.fleet_types import HostState, RunnerState, RunnerStatus
from exo_tasks.prefix_routing import (
    CHUNK_CHARS,
    can_take,
    conversation_digests,
    last_host,
    prompt_digests,
)
from exo_tasks.types import JobRequest, utcnow


def chat(*contents: str) -> JobRequest:
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    return JobRequest.model_validate({"messages": messages})


def test_a_chats_next_turn_begins_with_the_last_turn_and_its_answer() -> None:
    last = conversation_digests(chat("hi", "hello", "how are you?"), "fine")
    next_turn = prompt_digests(chat("hi", "hello", "how are you?", "fine", "good"))
    assert len(last) == 4 and len(next_turn) == 5 and next_turn[:4] == last
    # Another answer is another prefix from there on; another first message, from the start.
    other_answer = prompt_digests(chat("hi", "hello", "how are you?", "bad", "oh"))
    assert other_answer[:3] == last[:3] and other_answer[3] != last[3]
    assert prompt_digests(chat("hey", "hello"))[0] != last[0]


def test_a_texts_prefixes_are_whole_chunks_and_its_next_turn_shares_them() -> None:
    prompt = "x" * (2 * CHUNK_CHARS + 10)
    request = JobRequest.model_validate({"prompt": prompt})
    assert len(prompt_digests(request)) == 2  # the last 10 characters make no chunk
    assert prompt_digests(JobRequest.model_validate({"prompt": "short"})) == []
    after = conversation_digests(request, "y" * CHUNK_CHARS)
    assert len(after) == 3 and after[:2] == prompt_digests(request)
    next_turn = JobRequest.model_validate({"prompt": prompt + "y" * CHUNK_CHARS + "more?"})
    assert prompt_digests(next_turn) == after
    # Chunks are separated: "ab" + "c" is not "a" + "bc", and text is not chat.
    assert prompt_digests(JobRequest.model_validate({"prompt": "x" * CHUNK_CHARS})) != [
        prompt_digests(chat("x" * CHUNK_CHARS))[0]
    ]


def test_the_longest_prefix_some_host_ran_wins() -> None:
    assert last_host(["a", "b", None]) == "b"
    assert last_host(["a", None, None]) == "a"
    assert last_host([None, None]) is None
    assert last_host([]) is None


def fleet(active: int = 0, status: RunnerStatus = RunnerStatus.READY, **host: Any) -> Fleet:
    state = HostState(name="h", pid=1, models=["m"], started_at=utcnow(), **host)
    runner = RunnerState(id="m@h", host="h", model="m", status=status, active_jobs=active)
    return Fleet(hosts={"h": state}, runners={runner.id: runner})


def test_a_host_takes_a_job_its_prefix_prefers_until_saturated() -> None:
    assert can_take(fleet(), "m", "h", waiting=0, capacity=32)
    assert not can_take(fleet(), "m", "gone", waiting=0, capacity=32)
    assert not can_take(fleet(), "other-model", "h", waiting=0, capacity=32)
    assert not can_take(fleet(status=RunnerStatus.SHUTDOWN), "m", "h", waiting=0, capacity=32)
    # A full batch on its runner, counting the jobs already waiting in its queue.
    assert can_take(fleet(active=31), "m", "h", waiting=0, capacity=32)
    assert not can_take(fleet(active=31), "m", "h", waiting=1, capacity=32)
    # Every pool child of the host holds a job.
    assert not can_take(fleet(active=1, concurrency=1), "m", "h", waiting=0, capacity=32)
    assert can_take(fleet(active=1, concurrency=2), "m", "h", waiting=0, capacity=32)
    # Delivered to the host, not yet handed to its runner: a pool child is taken all the same.
    assert not can_take(fleet(held=["tag"], concurrency=1), "m", "h", waiting=0, capacity=32)
