"""Instances in Redis: each instance's record (its desired state: the supervisors of its hosts
read it, so a worker that was offline learns it on start), its ranks' records and the addresses
its ranks publish for the ring. Every write is a compare-and-set on the instance's status or
generation, so a rank of an older start never overwrites the new one's."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from exo_tasks.instances import (
    PENDING,
    InstanceMove,
    InstanceRecord,
    InstanceStatus,
    RankRecord,
    may_move,
    move,
)
from exo_tasks.store.client import NAMED_ARGS, RedisPart, named, one_set
from exo_tasks.store.keys import INSTANCES, instance_key, rank_wake_key

# How often place() looks again when another writer moved the instance between its read and
# its write (each retry reads the new state; two are plenty, this is a bound, not a wait).
PLACE_TRIES = 5

# KEYS: the instance's hash, the instance ids. ARGV: record, status, generation, id. Creates it
# unless it exists; 1 if created.
CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'record', ARGV[1], 'status', ARGV[2], 'generation', ARGV[3])
redis.call('SADD', KEYS[2], ARGV[4])
return 1
"""

# KEYS: the instance's hash, its ranks, its addresses. Arguments (NAMED_ARGS): `record`,
# `status`, `generation`; `from_generation`, the one it was made from; `allowed_from`, the
# statuses it may move from (`one_set`). A new generation starts with no rank records and no
# addresses.
TRANSITION = (
    NAMED_ARGS
    + """
if redis.call('HGET', KEYS[1], 'generation') ~= a.from_generation then return 0 end
if not one_of(redis.call('HGET', KEYS[1], 'status'), a.allowed_from) then return 0 end
redis.call('HSET', KEYS[1], 'record', a.record, 'status', a.status, 'generation', a.generation)
if a.generation ~= a.from_generation then redis.call('DEL', KEYS[2], KEYS[3]) end
return 1
"""
)

# KEYS: the instance's hash, its ranks. Arguments (NAMED_ARGS): `generation`, `rank`, `record`;
# `seen`, optional: the rank's status as the writer last read it. Written only while the
# instance is of that generation and, with `seen`, the stored record still has that status.
SET_RANK = (
    NAMED_ARGS
    + """
if redis.call('HGET', KEYS[1], 'generation') ~= a.generation then return 0 end
local stored = a.seen and redis.call('HGET', KEYS[2], a.rank)
if stored and cjson.decode(stored)['status'] ~= a.seen then return 0 end
redis.call('HSET', KEYS[2], a.rank, a.record)
return 1
"""
)

# A word to an idle rank that was not taken (the rank gone) goes with its key after this long.
WAKE_TTL_S = 3600

# KEYS: the instance's hash, then a hash of its ranks' addresses. ARGV: generation, rank,
# value. Written only while the instance is of that generation.
SET_IF_GENERATION = """
if redis.call('HGET', KEYS[1], 'generation') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
return 1
"""


class InstanceRecords(RedisPart):
    """Instances, their ranks and their ranks' addresses."""

    def place(self, record: InstanceRecord) -> tuple[InstanceRecord, bool]:
        """Create `record` (Pending), or find the instance of that id: one that has stopped
        (Shutdown or Failed) is placed again (Pending, its next generation); a live one is
        returned as it is. Whether this call created or restarted it, with the record now."""
        for _ in range(PLACE_TRIES):
            keys = [instance_key(record.id), INSTANCES]
            args = [record.model_dump_json(), record.status, record.generation, record.id]
            if self.script(CREATE)(keys=keys, args=args):
                return record, True
            existing = self.get(record.id)
            if existing is None:  # removed meanwhile: create it again
                continue
            if not existing.status.is_final:
                return existing, False
            restart = move(existing, PENDING)
            if self.apply(restart):
                return restart.record, True
        raise RuntimeError(f"instance '{record.id}' kept changing while it was placed")

    def apply(self, instance_move: InstanceMove) -> bool:
        """Write the move if the stored instance still allows it (its status and generation)."""
        record = instance_move.record
        keys = [
            instance_key(record.id),
            instance_key(record.id, "ranks"),
            instance_key(record.id, "addresses"),
        ]
        args = named(
            record=record.model_dump_json(),
            status=record.status,
            generation=record.generation,
            from_generation=instance_move.generation,
            allowed_from=one_set(instance_move.allowed_from),
        )
        return bool(self.script(TRANSITION)(keys=keys, args=args))

    def transition(
        self,
        instance_id: str,
        to: InstanceStatus,
        *,
        error: str | None = None,
        generation: int | None = None,
    ) -> InstanceRecord | None:
        """Move the instance to `to` from its status now, if the table allows it (and, with
        `generation`, only while it is of that generation); the record written, or None
        (unknown, not allowed, or moved by another writer meanwhile)."""
        current = self.get(instance_id)
        if current is None or not may_move(current.status, to):
            return None
        if generation is not None and current.generation != generation:
            return None
        instance_move = move(current, to, error=error)
        return instance_move.record if self.apply(instance_move) else None

    def get(self, instance_id: str) -> InstanceRecord | None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hget(instance_key(instance_id), "record")
        pipe.hgetall(instance_key(instance_id, "ranks"))
        raw, ranks = pipe.execute()
        return _with_ranks(raw, ranks) if raw else None

    def all(self) -> list[InstanceRecord]:
        """Every instance, by id."""
        return self.of(self.redis.smembers(INSTANCES))

    @staticmethod
    def read_ids(pipe: Any) -> None:
        """Every instance's id, read on a pipeline (whose reply `of` takes)."""
        pipe.smembers(INSTANCES)

    def of(self, instance_ids: Iterable[str]) -> list[InstanceRecord]:
        """These instances, by id: those that exist (none: no round trip)."""
        ids = sorted(instance_ids)
        pipe = self.redis.pipeline(transaction=False)
        for instance_id in ids:
            pipe.hget(instance_key(instance_id), "record")
            pipe.hgetall(instance_key(instance_id, "ranks"))
        replies = pipe.execute()
        pairs = zip(replies[::2], replies[1::2], strict=True)
        return [_with_ranks(raw, ranks) for raw, ranks in pairs if raw]

    def set_rank(
        self, instance_id: str, generation: int, rank: RankRecord, seen: str | None = None
    ) -> bool:
        """Update one rank's record; ignored (False) unless the instance is of `generation`
        and, given `seen` (the rank's status as the caller read it), unless no other writer
        changed its status since."""
        keys = [instance_key(instance_id), instance_key(instance_id, "ranks")]
        record = rank.model_dump_json()
        args = named(generation=generation, rank=rank.rank, record=record)
        if seen is not None:
            args += named(seen=seen)
        return bool(self.script(SET_RANK)(keys=keys, args=args))

    def publish_address(
        self, instance_id: str, generation: int, rank: int, address: str, port: int
    ) -> bool:
        """Where `rank` listens for its ring peers; ignored (False) unless the instance is of
        `generation`."""
        keys = [instance_key(instance_id), instance_key(instance_id, "addresses")]
        args = [generation, rank, f"{address}|{port}"]
        return bool(self.script(SET_IF_GENERATION)(keys=keys, args=args))

    def addresses(self, instance_id: str, generation: int) -> dict[int, tuple[str, int]]:
        """The addresses the ranks of `generation` published so far, by rank (none for an
        instance of another generation)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hget(instance_key(instance_id), "generation")
        pipe.hgetall(instance_key(instance_id, "addresses"))
        stored, published = pipe.execute()
        if stored != str(generation):
            return {}
        found = {}
        for rank, value in published.items():
            address, _, port = value.rpartition("|")
            found[int(rank)] = (address, int(port))
        return found

    def wake(self, instance_id: str, generation: int, ranks: Iterable[int]) -> None:
        """Tell idle follower `ranks` of `generation` that rank 0's next plan comes."""
        pipe = self.redis.pipeline(transaction=True)
        for rank in ranks:
            key = rank_wake_key(instance_id, generation, rank)
            pipe.rpush(key, 1)
            pipe.expire(key, WAKE_TTL_S)
        pipe.execute()

    def wait_for_wake(self, instance_id: str, generation: int, rank: int, timeout_s: float) -> bool:
        """Whether rank 0's word (`wake`) came within `timeout_s`; taken if so."""
        key = rank_wake_key(instance_id, generation, rank)
        return self.redis.blpop([key], timeout=timeout_s) is not None

    def remove(self, instance_id: str) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(
            instance_key(instance_id),
            instance_key(instance_id, "ranks"),
            instance_key(instance_id, "addresses"),
        )
        pipe.srem(INSTANCES, instance_id)
        pipe.execute()


def _with_ranks(raw: str, ranks: dict[str, str]) -> InstanceRecord:
    """The stored record with each rank's own latest record in place of the placed one."""
    record = InstanceRecord.model_validate_json(raw)
    latest = {int(rank): RankRecord.model_validate_json(value) for rank, value in ranks.items()}
    merged = [latest.get(rank.rank, rank) for rank in record.ranks]
    return record.model_copy(update={"ranks": merged})
