"""The one module that knows how kombu keeps Celery's messages in Redis.

- A queue is one Redis list per priority step: `queue` for step 0, `queue\\x06\\x16<step>` for
  the others; messages are JSON with the task id in `headers.id`.
- A message delivered to a worker and not yet acknowledged sits in the hash `unacked`
  (delivery tag → `[message, exchange, routing_key]`) and the sorted set `unacked_index`
  (delivery tag → delivery time). kombu gives it back only on a clean close of its consumer or
  once it is older than the visibility timeout: after a SIGKILL, an hour by default.
- kombu BRPOPs a message before it records it as unacknowledged: a worker killed in between
  loses it altogether.
- kombu closes a connection's channels one after the other and stops at the first that fails;
  the worker has it close all of them (`close_every_channel`).
- kombu builds a new redis-py client for each command it sends outside a consumer (each
  message published, each event); every process has a channel keep one (`reuse_clients`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kombu import Connection
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from config.celery import PRIORITY_STEPS

PRIORITY_SEP = "\x06\x16"
UNACKED = "unacked"
UNACKED_INDEX = "unacked_index"


def queue_lists(queue: str) -> list[str]:
    """A Celery queue's Redis lists, one per priority step."""
    return [f"{queue}{PRIORITY_SEP}{step}" if step else queue for step in PRIORITY_STEPS]


# KEYS: a queue's lists (queue_lists); ARGV[1]: a task id. Drops the first message of that task
# still waiting there; 1 if it did, 0 if none waits (taken by a worker, or dropped already). A
# substring search first: decoding every message of a long queue would hold Redis far longer.
WITHDRAW = """
for _, key in ipairs(KEYS) do
  for _, raw in ipairs(redis.call('LRANGE', key, 0, -1)) do
    if string.find(raw, ARGV[1], 1, true) then
      local ok, message = pcall(cjson.decode, raw)
      if ok and type(message) == 'table' and type(message.headers) == 'table'
          and message.headers.id == ARGV[1] then
        return redis.call('LREM', key, 1, raw)
      end
    end
  end
end
return 0
"""


def _task_id(raw: str, *, unacked: bool = False) -> str | None:
    """The task id in a raw message (an unacked entry wraps it in a list), None for anything
    that is not a Celery message: one foreign entry must not stop the recovery loop."""
    try:
        message = json.loads(raw)
    except ValueError:
        return None
    if unacked:
        message = message[0] if isinstance(message, list) and message else None
    headers = message.get("headers") if isinstance(message, dict) else None
    task_id = headers.get("id") if isinstance(headers, dict) else None
    return task_id if isinstance(task_id, str) else None


@dataclass(frozen=True)
class Unacked:
    """A message delivered to some worker and not acknowledged yet."""

    tag: str
    task_id: str | None
    delivered_at: float

    def age_s(self, now: float) -> float:
        return now - self.delivered_at


@dataclass(frozen=True)
class Messages:
    """Where the broker's messages are, read in one transaction (a message moving from a queue
    to `unacked` meanwhile is seen in exactly one of them)."""

    queued_task_ids: set[str]
    unacked: list[Unacked]

    def has_task(self, task_id: str) -> bool:
        return task_id in self.queued_task_ids or any(u.task_id == task_id for u in self.unacked)


def read_messages(redis: Any, queues: Iterable[str]) -> Messages:
    """Every message waiting in `queues` and every unacknowledged one, in one transaction."""
    pipe = redis.pipeline(transaction=True)
    for key in [key for queue in sorted(set(queues)) for key in queue_lists(queue)]:
        pipe.lrange(key, 0, -1)
    pipe.hgetall(UNACKED)
    pipe.zrange(UNACKED_INDEX, 0, -1, withscores=True)
    *queued, unacked, index = pipe.execute()
    task_ids = {
        task_id
        for raw_messages in queued
        for raw in raw_messages
        if (task_id := _task_id(raw)) is not None
    }
    delivered = dict(index)
    entries = [
        Unacked(tag=tag, task_id=_task_id(raw, unacked=True), delivered_at=delivered[tag])
        for tag, raw in unacked.items()
        if tag in delivered
    ]
    return Messages(queued_task_ids=task_ids, unacked=entries)


class Broker:
    """Reads kombu's layout directly; gives messages back through kombu itself, so a restore
    is exactly the one kombu would make (priority list, `redelivered` flag) and happens once
    even when two workers try it (kombu WATCHes the `unacked` hash)."""

    def __init__(self, redis: Any, connect: Callable[[], Connection]) -> None:
        self.redis = redis
        self._connect = connect

    def messages(self, queues: Iterable[str]) -> Messages:
        return read_messages(self.redis, queues)

    def restore(self, tags: Iterable[str]) -> None:
        """Put unacknowledged messages back at the head of their queues (they are the oldest
        there: kombu pushes new messages on the left and pops them on the right)."""
        with self._connect() as connection:
            channel: Any = connection.default_channel
            for tag in tags:
                channel.qos.restore_by_tag(tag)


CLOSE_TRIES = 32


def close_every_channel() -> None:
    """Have kombu's Redis transport close every channel of a connection, even with Redis gone.

    kombu stops at the first channel whose close fails (with Redis gone: the reply of a pending
    BRPOP, deleting the broadcast queue) and leaves the rest open. Celery's reconnect then
    closes the task channel again once its transport has lost its client, and the worker dies
    ("Unrecoverable error: AttributeError ... 'hostname'"; celery and kombu 5.7) instead of
    reconnecting when Redis is back. Patched in place, not as a transport of our own: that would
    name the broker URL's scheme after it, and Flower reads the scheme to find the broker."""
    kombu_redis.Transport.close_connection = _close_every_channel  # type: ignore[method-assign,assignment]


def _close_every_channel(transport: virtual.Transport, connection: Connection) -> None:
    # kombu takes each channel off its lists before closing it: each try closes those left
    # (a connection has a handful of channels).
    for _ in range(CLOSE_TRIES):
        try:
            virtual.Transport.close_connection(transport, connection)
            return
        except transport.connection_errors:
            continue


def reuse_clients() -> None:
    """Have each kombu Redis channel keep one redis-py client per connection pool, instead of
    building one for every message and event it publishes. Building one fills a dict of ~170
    reply parsers (160 µs): twice per job the API sends, a tenth of its CPU per job. A client
    is only a handle on the pool, safe to share between threads; kombu never closes these."""
    _channel_class._create_client = _client_of_channel


_channel_class: Any = kombu_redis.Channel  # its stubs leave out the private method
_build_client = _channel_class._create_client


def _client_of_channel(channel: Any, asynchronous: bool = False) -> Any:
    if asynchronous:  # the consumer's own, built once by kombu
        return _build_client(channel, asynchronous=True)
    kept = channel.__dict__.get("_exo_client")
    if kept is None or kept.connection_pool is not channel.pool:
        kept = channel._exo_client = _build_client(channel)
    return kept
