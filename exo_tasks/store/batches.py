"""Batches (OpenAI's Batch API) in Redis: each batch's record, and while it runs the parts its
feeder keeps (exo_tasks.batch.feeder): where each request is in the input file, which lines
are jobs now, and how each line ended.

Exactly once: a line's result is written with HSETNX, so however often a feeder that was
killed goes over the same line again, the line has one result and is counted once.
"""

from __future__ import annotations

from exo_tasks.batch_types import Batch, RequestCounts
from exo_tasks.lifecycle import BatchMove
from exo_tasks.store.client import NAMED_ARGS, RedisPart, named, one_set
from exo_tasks.store.keys import BATCHES, BATCHES_OPEN, batch_key, file_key

# KEYS: batch hash. Arguments (NAMED_ARGS): `status`, the new one; `record`; `allowed_from`,
# the statuses it may move from (`one_set`).
MOVE = (
    NAMED_ARGS
    + """
if not one_of(redis.call('HGET', KEYS[1], 'status'), a.allowed_from) then return 0 end
redis.call('HSET', KEYS[1], 'status', a.status, 'record', a.record)
return 1
"""
)

# KEYS: results hash, batch hash, inflight set. ARGV: line, result, counter field.
RESULT = """
local written = redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
if written == 1 then redis.call('HINCRBY', KEYS[2], ARGV[3], 1) end
redis.call('SREM', KEYS[3], ARGV[1])
return written
"""
OK, FAILED = "o", "e"  # a result's first character: the output file's or the error file's
SPANS_PER_PUSH = 5000


class BatchRecords(RedisPart):
    def create(self, batch: Batch) -> None:
        pipe = self.redis.pipeline(transaction=True)
        record = {"status": batch.status, "record": batch.model_dump_json()}
        pipe.hset(batch_key(batch.id), mapping=record)
        pipe.zadd(BATCHES, {batch.id: batch.created_at})
        pipe.sadd(BATCHES_OPEN, batch.id)
        pipe.execute()

    def get(self, batch_id: str) -> Batch | None:
        """The batch, its request counts as they are now."""
        record, completed, failed = self.redis.hmget(
            batch_key(batch_id), "record", "completed", "failed"
        )
        if record is None:
            return None
        batch = Batch.model_validate_json(record)
        if not batch.ended:
            counts = RequestCounts(
                total=batch.request_counts.total,
                completed=int(completed or 0),
                failed=int(failed or 0),
            )
            batch = batch.model_copy(update={"request_counts": counts})
        return batch

    def page(self, after: str | None, limit: int) -> tuple[list[Batch], bool] | None:
        """Batches newest first, from the one after `after`; whether more follow."""
        page = self.newest_after(BATCHES, after, limit)
        if page is None:
            return None
        ids, more = page
        return [b for b in (self.get(i) for i in ids) if b is not None], more

    def move(self, move: BatchMove) -> bool:
        """Execute one of exo_tasks.lifecycle's batch moves; whether it was written."""
        batch = move.batch
        args = named(
            status=batch.status,
            record=batch.model_dump_json(),
            allowed_from=one_set(move.allowed_from),
        )
        return bool(self.script(MOVE)(keys=[batch_key(batch.id)], args=args))

    def open_ids(self) -> list[str]:
        """The batches not yet ended, oldest first."""
        ids = self.redis.smembers(BATCHES_OPEN)
        scores = self.redis.zmscore(BATCHES, list(ids)) if ids else []
        return [i for _, i in sorted(zip((s or 0 for s in scores), ids, strict=True))]

    def open_reading(self, file_id: str) -> Batch | None:
        """A batch not yet ended whose input is the file, if any."""
        batches = (self.get(batch_id) for batch_id in self.open_ids())
        return next((b for b in batches if b and b.input_file_id == file_id and not b.ended), None)

    def open_count(self) -> int:
        return int(self.redis.scard(BATCHES_OPEN))

    # --- the feeder's parts ---

    def set_spans(self, batch_id: str, spans: list[tuple[int, int]]) -> None:
        key = batch_key(batch_id, "spans")
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(key)
        for i in range(0, len(spans), SPANS_PER_PUSH):
            pipe.rpush(key, *(f"{a} {b}" for a, b in spans[i : i + SPANS_PER_PUSH]))
        pipe.execute()

    def input_lines(self, batch_id: str, file_id: str, lines: list[int]) -> list[str]:
        """The raw text of some of a batch's requests, in two round trips."""
        pipe = self.redis.pipeline(transaction=False)
        for line in lines:
            pipe.lindex(batch_key(batch_id, "spans"), line)
        spans = [span.split() for span in pipe.execute()]
        pipe = self.redis.pipeline(transaction=False)
        for start, end in spans:
            pipe.getrange(file_key(file_id, "content"), int(start), int(end) - 1)
        texts: list[str] = pipe.execute()
        return texts

    def cursor(self, batch_id: str) -> int:
        """The next line to send as a job."""
        return int(self.redis.hget(batch_key(batch_id), "cursor") or 0)

    def take_lines(self, batch_id: str, jobs: list[int], cursor: int) -> None:
        """The cursor moves to `cursor`: the lines before it are jobs now (`jobs`) or have
        their results."""
        pipe = self.redis.pipeline(transaction=True)
        if jobs:
            pipe.sadd(batch_key(batch_id, "inflight"), *jobs)
        pipe.hset(batch_key(batch_id), "cursor", cursor)
        pipe.execute()

    def inflight(self, batch_id: str) -> list[int]:
        return sorted(int(i) for i in self.redis.smembers(batch_key(batch_id, "inflight")))

    def write_results(self, batch_id: str, results: list[tuple[int, bool, str]]) -> list[bool]:
        """Each (line, ok, result) unless the line has a result already, in one round trip;
        whether each was written."""
        keys = [batch_key(batch_id, p) for p in ("results", None, "inflight")]
        pipe = self.redis.pipeline(transaction=False)
        for line, ok, result in results:
            args = [line, (OK if ok else FAILED) + result, "completed" if ok else "failed"]
            pipe.eval(RESULT, len(keys), *keys, *args)
        return [bool(written) for written in pipe.execute()]

    def lines_with_results(self, batch_id: str) -> set[int]:
        return {int(line) for line in self.redis.hkeys(batch_key(batch_id, "results"))}

    def results(self, batch_id: str) -> tuple[list[str], list[str]]:
        """The output and error lines, each in input order."""
        stored = self.redis.hgetall(batch_key(batch_id, "results"))
        ordered = [stored[k] for k in sorted(stored, key=int)]
        return [r[1:] for r in ordered if r[0] == OK], [r[1:] for r in ordered if r[0] == FAILED]

    def close(self, move: BatchMove) -> bool:
        """Execute a move that ends the batch, and drop what its feeder kept."""
        if not self.move(move):
            return False
        batch_id = move.batch.id
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(*(batch_key(batch_id, part) for part in ("spans", "inflight", "results")))
        pipe.srem(BATCHES_OPEN, batch_id)
        pipe.execute()
        return True
