"""Fair admission across clients: who sent a job, and where in its priority class it waits.

A client is the request's `user` when it names one, else the API token it authenticated with,
else its address; each batch is a client of its own. A client may have
EXO_MAX_QUEUED_JOBS_PER_CLIENT jobs waiting at once (then 429), counted where the job is created
(exo_tasks.store.jobs).

A worker takes the next message of its queues by priority step (kombu BRPOPs every step of
every queue it consumes, the lower step first), first in, first out within a step. Each
priority class has a few steps (config.celery.PRIORITY_CLASSES), and a job waits at the step
given by how many jobs its client already has waiting in its class: none, the class's first
step; 1, the second; 2-3, the third; 4 or more, the fourth. So a client has at most one job at
its class's first step at any time (its next job finds that one waiting), and a client's first
job waits behind at most one job of each other client: with few clients, one turn of the jobs
already running. Past the last step it is first in, first out again. A job keeps its step when
it goes back to its queue (exo_tasks.jobs.resend; kombu restores a message to its own step).
Pure: the API, the batch feeder and the store use it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from config.celery import PRIORITY_CLASSES
from exo_tasks.types import Priority

LABEL_CHARS = 64


@dataclass(frozen=True)
class Client:
    """Who a job is for: `key` names the client in Redis (a digest: any `user` string makes a
    short key), `label` in messages."""

    key: str
    label: str


def _client(kind: str, value: str, label: str) -> Client:
    digest = hashlib.sha256(f"{kind}\0{value}".encode(errors="surrogatepass")).hexdigest()
    return Client(key=f"{kind}-{digest[:32]}", label=label)


def client_of(user: str | None, token: str | None, address: str | None) -> Client:
    """The client a request comes from: its `user`, else its API token, else its address."""
    if user:
        shown = user if len(user) <= LABEL_CHARS else user[:LABEL_CHARS] + "…"
        return _client("user", user, f"user {shown!r}")
    if token:
        return _client("token", token, "this API token")
    return _client("address", address or "", f"address {address or 'unknown'}")


def batch_client(batch_id: str) -> Client:
    """A batch's lines count as one client of their own."""
    return _client("batch", batch_id, f"batch {batch_id}")


def step_for(priority: Priority, waiting: int) -> int:
    """The priority step of a job of class `priority` whose client has `waiting` jobs of that
    class waiting already: one step later each time that number reaches a power of two."""
    steps = PRIORITY_CLASSES[priority]
    return steps[min(waiting.bit_length(), len(steps) - 1)]


def step_table(priority: Priority) -> list[int]:
    """step_for(priority, waiting) for waiting = 0, 1, ... up to the first count that reaches
    the class's last step: the store's creation script looks a job's step up here (the last
    entry for any count past the end), with the count it makes."""
    last = len(PRIORITY_CLASSES[priority]) - 1
    return [step_for(priority, waiting) for waiting in range(2 ** max(last - 1, 0) + 1)]
