"""Hosts in Redis: each worker's expiring heartbeat (its incarnation), the recovery loop's
lease, the fleet as the API reads it, each host's supervisor inbox, and which host ran which
prompt prefixes (exo_tasks.prefix_routing)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter

from exo_tasks.commands import SupervisorRequest
from exo_tasks.fleet_types import HostState, RunnerState
from exo_tasks.store.client import RedisPart
from exo_tasks.store.keys import (
    HOSTS,
    RECOVERY_LEASE,
    RUNNERS,
    host_key,
    prefix_key,
    runner_key,
    supervisor_key,
)
from exo_tasks.types import JobRecord

_supervisor_adapter: TypeAdapter[SupervisorRequest] = TypeAdapter(SupervisorRequest)

# KEYS: live hosts, runners. ARGV: host key prefix, runner key prefix. Every live host's and
# runner's state; hosts whose heartbeat expired are forgotten.
FLEET = """
local hosts, runners = {}, {}
for _, name in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local raw = redis.call('GET', ARGV[1] .. name)
  if raw then table.insert(hosts, raw) else redis.call('SREM', KEYS[1], name) end
end
for _, id in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local raw = redis.call('GET', ARGV[2] .. id)
  if raw then table.insert(runners, raw) end
end
return {hosts, runners}
"""


# KEYS: live hosts, then prefix keys. ARGV: host key prefix, milliseconds, host. Sets each
# prefix key to the host, only where another host is live too: a lone host has no choice to
# make, and writes nothing for each job.
REMEMBER_PREFIXES = """
local live = 0
for _, name in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  live = live + redis.call('EXISTS', ARGV[1] .. name)
end
if live < 2 then return 0 end
for i = 2, #KEYS do redis.call('SET', KEYS[i], ARGV[3], 'PX', ARGV[2]) end
return 1
"""


@dataclass(frozen=True)
class PrefixHint:
    """`host` ran these prompt prefixes of `model` (exo_tasks.prefix_routing): its prompt cache
    holds them, so a job beginning with one is best sent there, for `ttl_s`."""

    model: str
    digests: list[str]
    host: str
    ttl_s: float

    def write(self, pipe: Any) -> None:
        """Queued on `pipe` (a runner's step, with the ending of the job that ran them): EVAL,
        not EVALSHA, which a pipeline would precede with a round trip of its own."""
        keys = [HOSTS, *(prefix_key(self.model, digest) for digest in self.digests)]
        args = [host_key(""), int(self.ttl_s * 1000), self.host]
        pipe.eval(REMEMBER_PREFIXES, len(keys), *keys, *args)


# KEYS: the lease. ARGV: holder, milliseconds. Taken if free, renewed if ours.
LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""


class HostRecords(RedisPart):
    """Live hosts, the recovery lease and supervisor inboxes."""

    def publish(self, state: HostState, ttl_s: float) -> bool:
        """The host's heartbeat; whether its last one had not expired yet."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.exists(host_key(state.name))
        pipe.set(host_key(state.name), state.model_dump_json(), px=int(ttl_s * 1000))
        pipe.sadd(HOSTS, state.name)
        return bool(pipe.execute()[0])

    def remove(self, host: str) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(host_key(host))
        pipe.srem(HOSTS, host)
        pipe.execute()

    def get(self, host: str) -> HostState | None:
        raw = self.redis.get(host_key(host))
        return HostState.model_validate_json(raw) if raw else None

    def owner_is_live(self, job: JobRecord) -> bool:
        """Whether the worker incarnation holding a running job still beats; a job recorded
        before owners existed counts as held."""
        if job.owner is None or job.host is None:
            return True
        host = self.get(job.host)
        return host is not None and host.incarnation == job.owner

    def hold_lease(self, holder: str, ttl_s: float, key: str = RECOVERY_LEASE) -> bool:
        """Take or keep a lease: the recovery loop's, or another `key` (one holder at a time;
        it lapses after `ttl_s` unless renewed)."""
        return bool(self.script(LEASE)(keys=[key], args=[holder, int(ttl_s * 1000)]))

    def fleet(self) -> tuple[list[HostState], list[RunnerState]]:
        """The hosts whose heartbeat has not expired (expired ones are forgotten) and every
        runner, by name, in one round trip: the API reads both for every job it takes."""
        keys = [HOSTS, RUNNERS]
        return fleet_of(self.script(FLEET)(keys=keys, args=[host_key(""), runner_key("")]))

    @staticmethod
    def read_fleet(pipe: Any) -> None:
        """`fleet`'s read, queued on a pipeline (whose reply `fleet_of` reads): EVAL, not
        EVALSHA, which a pipeline would precede with a round trip of its own (SCRIPT EXISTS)."""
        pipe.eval(FLEET, 2, HOSTS, RUNNERS, host_key(""), runner_key(""))

    def prefix_hosts(self, model: str, digests: list[str]) -> list[str | None]:
        """The host that ran each of these prompt prefixes of `model` lately, or None."""
        return list(self.redis.mget([prefix_key(model, digest) for digest in digests]))

    def send_to_supervisor(self, host: str, request: SupervisorRequest) -> None:
        self.redis.rpush(supervisor_key(host), request.model_dump_json())

    def next_supervisor_request(self, host: str, timeout_s: float) -> SupervisorRequest | None:
        reply = self.redis.blpop([supervisor_key(host)], timeout=timeout_s)
        return _supervisor_adapter.validate_json(reply[1]) if reply else None


def fleet_of(reply: list[list[str]]) -> tuple[list[HostState], list[RunnerState]]:
    """The hosts and the runners in a reply of FLEET, each by name."""
    host_raws, runner_raws = reply
    hosts = [HostState.model_validate_json(raw) for raw in host_raws]
    runners = [RunnerState.model_validate_json(raw) for raw in runner_raws]
    return sorted(hosts, key=lambda h: h.name), sorted(runners, key=lambda r: r.id)
