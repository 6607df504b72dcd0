"""The Redis connection the store's parts share, and which of Redis's refusals a writer waits
out (exo_tasks.errors reads an out-of-memory reply)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import redis

from exo_tasks.errors import is_out_of_memory, redis_unreachable
from exo_tasks.redis_sentinel import Sentinels, is_sentinel_url


def connect(url: str, *, max_connections: int | None = None) -> redis.Redis:
    """A client of its own pool; `max_connections`: a pool of at most that many, where a
    command waits (up to the socket timeout) for a free connection instead of opening one.
    A `redis+sentinel://` URL: a client of the master its Sentinels name, found again on each
    new connection (exo_tasks.redis_sentinel)."""
    # Short connect timeout: with Redis down, callers fail fast instead of hanging.
    options: dict[str, Any] = {
        "decode_responses": True,
        "socket_connect_timeout": 1.0,
        "socket_timeout": 10.0,
        "health_check_interval": 30,
    }
    if is_sentinel_url(url):
        return Sentinels.from_url(url).master(options, max_connections)
    if max_connections is None:
        return redis.Redis.from_url(url, **options)
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=10.0, **options
    )
    return redis.Redis(connection_pool=pool)


def redis_waits(exc: BaseException) -> bool:
    """Redis is unreachable, or full (it refuses writes until keys expire): the writer keeps
    what it owes Redis and tries again, rather than failing its jobs. Also as the cause of
    kombu's error: a Celery message that could not be sent."""
    return redis_unreachable(exc) or is_out_of_memory(exc)


# The head of every script that takes its arguments by name (`named`): ARGV read into the table
# `a`, and `one_of`, whether a value (false: a field that is not there) is in a set that
# `one_set` passed.
NAMED_ARGS = """
local a = {}
for i = 1, #ARGV, 2 do a[ARGV[i]] = ARGV[i + 1] end
local function one_of(value, set)
  return value and string.find(' ' .. set .. ' ', ' ' .. value .. ' ', 1, true) ~= nil
end
"""
Arg = str | int | float


class PipelineWrite(Protocol):
    """A write queued on a pipeline, to go in one round trip with others (a script's call, a
    runner's state)."""

    def queue_on(self, pipe: Any) -> None: ...


@dataclass(frozen=True)
class ScriptCall:
    """One call of a Lua script, to run alone (`RedisPart.run`) or with others in one round
    trip (`queue_on` a pipeline: EVAL with its text, for a pipeline's EVALSHA would first ask
    SCRIPT EXISTS, a round trip of its own)."""

    text: str
    keys: list[str]
    args: list[Arg]

    def queue_on(self, pipe: Any) -> None:
        pipe.eval(self.text, len(self.keys), *self.keys, *self.args)


def named(**args: Arg) -> list[Arg]:
    """A script's arguments by name, for a script that begins with NAMED_ARGS."""
    return [item for pair in args.items() for item in pair]


def one_set(values: Iterable[object]) -> str:
    """A set of words (statuses, numbers) as one argument, for `one_of` or a script's own
    `gmatch` (no word has a space)."""
    return " ".join(map(str, values))


class RedisPart:
    """What every part of the store holds: the client the parts share, and its scripts."""

    def __init__(self, client: redis.Redis) -> None:
        # Any: redis-py 8's annotations are not generic over decode_responses (every reply is
        # typed `bytes | str`, every pipeline reply Any), so a typed client would be a cast
        # per call; the store's methods are typed instead.
        self.redis: Any = client
        self._scripts: dict[str, Any] = {}

    def script(self, text: str) -> Any:
        """A Lua script, registered once (EVALSHA, loaded on first use)."""
        registered = self._scripts.get(text)
        if registered is None:
            registered = self._scripts[text] = self.redis.register_script(text)
        return registered

    def run(self, call: ScriptCall) -> Any:
        return self.script(call.text)(keys=call.keys, args=call.args)

    def start_after(self, index: str, after: str | None) -> int | None:
        """Where a newest-first page of a sorted-set index starts: just past `after` (0 without
        one); None if `after` is not in the index."""
        if after is None:
            return 0
        rank = self.redis.zrevrank(index, after)
        return None if rank is None else rank + 1

    def newest_after(
        self, index: str, after: str | None, limit: int
    ) -> tuple[list[str], bool] | None:
        """Up to `limit` ids of a sorted-set index, newest first, from the one after `after`;
        whether more follow. None if `after` is not in the index."""
        start = self.start_after(index, after)
        if start is None:
            return None
        ids: list[str] = self.redis.zrevrange(index, start, start + limit)
        return ids[:limit], len(ids) > limit
