"""Prefix-aware routing, when several hosts serve a model: a job whose prompt begins with what
one host ran lately goes to that host's queue, where its runner's prompt cache holds the prefix
(exo_tasks.runner.prompt_cache), unless that host is saturated. The map from prefixes to hosts is a
hint kept in Redis for EXO_PREFIX_ROUTING_TTL_S: a host that evicted the prefix since costs one
cache miss, never a wrong answer.

A prompt's prefixes are named by digests: for a chat, one after each message; for text, one
after each CHUNK_CHARS characters (a prefix ending mid-chunk is not named). Pure: the API and
the runners compute digests here; exo_tasks.store keeps the map."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from exo_tasks.naming import runner_id_for
from exo_tasks.types import ChatMessage, JobRequest

if TYPE_CHECKING:  # a runner computes digests too, and needs nothing of the fleet
    from exo_tasks.fleet import Fleet

CHUNK_CHARS = 256


def _digests(kind: str, chunks: Iterable[str]) -> list[str]:
    """The digest of every prefix of `chunks`, shortest first (one running hash: linear)."""
    running = hashlib.blake2b(kind.encode(), digest_size=16)
    found = []
    for chunk in chunks:
        running.update(chunk.encode())
        running.update(b"\x1e")  # a separator: chunks "ab", "c" are not "a", "bc"
        found.append(running.copy().hexdigest())
    return found


def _text_chunks(text: str) -> list[str]:
    return [text[i : i + CHUNK_CHARS] for i in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS)]


def _message_chunks(messages: list[ChatMessage]) -> list[str]:
    return [message.model_dump_json(exclude_none=True) for message in messages]


def prompt_digests(request: JobRequest) -> list[str]:
    """The digests of the prefixes of the job's prompt, shortest first."""
    if request.messages is not None:
        return _digests("chat", _message_chunks(request.messages))
    return _digests("text", _text_chunks(request.prompt or ""))


def conversation_digests(request: JobRequest, answer: str) -> list[str]:
    """The digests of the prefixes of the job's prompt followed by its answer, as the next turn
    of the conversation resends them: after the answer message, or the answer's text."""
    if request.messages is not None:
        answered = [*request.messages, ChatMessage(role="assistant", content=answer)]
        return _digests("chat", _message_chunks(answered))
    return _digests("text", _text_chunks((request.prompt or "") + answer))


def last_host(hosts_by_prefix: list[str | None]) -> str | None:
    """The host that ran the longest prefix (`hosts_by_prefix`: the map's hosts for
    prompt_digests, in their order)."""
    return next((host for host in reversed(hosts_by_prefix) if host is not None), None)


def can_take(fleet: Fleet, model: str, host: str, waiting: int, capacity: int) -> bool:
    """Whether `host` is live, serves `model` on a runner that takes jobs, and is not
    saturated: with the `waiting` jobs of its own queue, fewer than `capacity` jobs on the
    runner (a full batch) and fewer than its pool children on the host (each job holds one,
    from its delivery on: the messages the host holds count too)."""
    runner = fleet.runners.get(runner_id_for(model, host))
    if not fleet.serves(host, model) or runner is None or not runner.status.accepts_jobs:
        return False
    state = fleet.hosts[host]
    running = sum(r.active_jobs for r in fleet.host_runners(host))
    on_host = max(running, len(state.held)) + waiting
    children = state.concurrency
    return runner.active_jobs + waiting < capacity and (children is None or on_host < children)
