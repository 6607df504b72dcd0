"""The batch feeder: drives every open batch, from validation to its output files.

It runs in a process of its own beside each worker (exo_tasks.batch.process), one at a time
(a lease in Redis, taken over within seconds when its holder dies), and keeps nothing in memory
that Redis does not have: a feeder that was killed anywhere is continued by the next holder, and
every step is one it can repeat. A line runs as a job whose id follows from the line, sent
at `low` priority only while the fleet has room: at most EXO_BATCH_MAX_QUEUED batch jobs
waiting in the queues and EXO_BATCH_INFLIGHT_PER_HOST per live host at all, so interactive
jobs never wait behind a batch. A line's result is written once (exo_tasks.store.batches).

No batch can stop the others: whatever a step of one batch raises (but Redis being away,
which every batch waits out alike) ends that batch `failed`, its `errors` saying why, and the
tick goes on with the rest. A line that cannot be read is an error line of its batch.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pydantic import ValidationError

from exo_tasks import fairness, jobs, json_input, lifecycle, metrics, replication
from exo_tasks.batch import input as batch_input
from exo_tasks.batch.jobs import cancel_inflight, line_job_id
from exo_tasks.batch.results import ENDPOINTS, LineResults, result_file, succeeded
from exo_tasks.batch_types import (
    Batch,
    BatchError,
    BatchErrors,
    BatchStatus,
    RequestCounts,
    ResultLine,
)
from exo_tasks.celery_app import ExoCelery
from exo_tasks.errors import ExoError, InvalidRequest, QueueFull, Unavailable
from exo_tasks.store import redis_waits
from exo_tasks.store.keys import BATCH_FEEDER_LEASE
from exo_tasks.types import JobRecord, JobStatus

log = logging.getLogger("exo_tasks.batches")
TICK_S = 0.1
LEASE_TTL_S = 5.0
REDIS_RETRY_S = 0.5
# A batch being cancelled or past its window: its jobs in flight are asked to stop this often
# until they have all ended (the API's cancel asks at once).
CANCEL_EVERY_S = 1.0
# Pool children on each host that batch jobs leave free, for interactive jobs.
RESERVED_CHILDREN = 2
# Lines sent side by side: each send waits on a few round trips to Redis.
SENDERS = 8


class Sent(enum.Enum):
    SENT = "sent"


SENT = Sent.SENT


@dataclass
class Room:
    """How many more batch jobs the fleet takes now, all batches together."""

    inflight: int
    queued: int

    def take(self) -> None:
        self.inflight -= 1
        self.queued -= 1

    @property
    def left(self) -> int:
        return max(0, min(self.inflight, self.queued))


class BatchFeeder:
    def __init__(self, app: ExoCelery, holder: str) -> None:
        self.app = app
        self.store = app.store
        self.settings = app.settings
        self.replica_wait_ms = replication.wait_ms(self.settings)
        self.holder = holder
        self.results = LineResults()
        self._closing = threading.Event()
        self._cancelled_at: dict[str, float] = {}
        self._moved = 0  # lines sent or ended in the last tick
        self._senders = ThreadPoolExecutor(SENDERS, thread_name_prefix="batch-send")

    def stop(self) -> None:
        self._closing.set()

    def run(self) -> None:
        """Tick until stopped, holding the feeder's lease (exo_tasks.batch.process runs this)."""
        try:
            self._run()
        finally:
            self._senders.shutdown(wait=True, cancel_futures=True)

    def _run(self) -> None:
        pause = 0.0
        while not self._closing.wait(pause):
            self._moved = 0
            try:
                if self.store.hosts.hold_lease(self.holder, LEASE_TTL_S, BATCH_FEEDER_LEASE):
                    self.tick()
                # At once again after a tick that moved lines (the fleet is waiting), else a pause.
                pause = 0 if self._moved else TICK_S
            except Exception as exc:  # the loop must outlive any tick
                if redis_waits(exc):
                    # Redis restarting, say: a line each try, not a traceback ten times a second.
                    # Every step is one the next tick repeats: the batch goes on once it is back.
                    log.warning(
                        "redis unreachable or full; batch feeder waits", extra={"error": str(exc)}
                    )
                    pause = REDIS_RETRY_S
                else:
                    log.exception("batch feeder tick failed; retrying")
                    pause = TICK_S

    def tick(self) -> None:
        batches = [b for b in map(self.store.batches.get, self.store.batches.open_ids()) if b]
        if not batches:
            return
        room = Room(self._fleet_room(), self.settings.batch_max_queued)
        running = [batch for batch in batches if self._guarded(self._advance, batch, room)]
        for batch in running:
            self._guarded(self.feed, batch, room)

    def _guarded(self, step: Callable[[Batch, Room], object], batch: Batch, room: Room) -> bool:
        """`step` of one batch, and its answer as a bool; False if it raised: the batch fails
        alone and the tick goes on. Redis away is no batch's fault: the tick waits it out."""
        try:
            return bool(step(batch, room))
        except Exception as exc:
            if redis_waits(exc):
                raise
            log.exception("batch cannot go on", extra={"batch_id": batch.id})
            self._fail(batch, f"the batch could not go on: {type(exc).__name__}: {exc}")
            return False

    def _advance(self, batch: Batch, room: Room) -> bool:
        """Validate the batch, or collect its lines that ended and end it if it is done;
        True if it takes more lines. Its jobs in flight are taken from the room."""
        if batch.status == BatchStatus.VALIDATING:
            self.validate(batch)
            return False
        if not self.store.files.exists(batch.input_file_id):
            self._fail(batch, f"its input file '{batch.input_file_id}' was deleted while it ran")
            return False
        still = self.collect(batch)
        room.inflight -= len(still)
        room.queued -= sum(status == JobStatus.QUEUED for status in still)
        return not self._ended(batch, still)

    def _fleet_room(self) -> int:
        """Batch jobs the live hosts run at once: on each, EXO_BATCH_INFLIGHT_PER_HOST, but
        never so many that its pool has no child left for an interactive job."""
        per_host = self.settings.batch_inflight_per_host
        return sum(
            min(per_host, (host.concurrency or per_host) - RESERVED_CHILDREN)
            for host in self.store.hosts.fleet()[0]
            if not host.stopping  # its shutdown has begun: it takes no more jobs
        )

    # --- validating ---

    def validate(self, batch: Batch) -> None:
        content = self.store.files.content(batch.input_file_id)
        if content is None:
            checked = batch_input.CheckedInput()
            checked.fail("file_not_found", f"input file '{batch.input_file_id}' was deleted", None)
        else:
            checked = batch_input.check(
                content.encode(), batch.endpoint, self.settings.batch_max_lines
            )
        now = int(time.time())
        if checked.errors:
            errors = BatchErrors(data=checked.errors)
            self.store.batches.close(
                lifecycle.move_batch(batch, BatchStatus.FAILED, now, errors=errors)
            )
            return
        self.store.batches.set_spans(batch.id, checked.spans)
        counts = RequestCounts(total=len(checked.spans))
        started = lifecycle.move_batch(batch, BatchStatus.IN_PROGRESS, now, request_counts=counts)
        self.store.batches.move(started)

    # --- collecting the jobs that ended ---

    def collect(self, batch: Batch) -> list[JobStatus]:
        """Write the result of each of the batch's jobs that ended; the statuses of the rest."""
        lines = self.store.batches.inflight(batch.id)
        records = self.store.jobs.records([line_job_id(batch.id, line) for line in lines])
        still: list[JobStatus] = []
        ended: list[tuple[int, JobRecord | None]] = []
        for line, job in zip(lines, records, strict=True):
            if job is None or job.is_terminal:
                ended.append((line, job))
            else:
                still.append(job.status)
        if ended:
            self._write(batch, self._ended_lines(batch, ended))
        return still

    def _ended_lines(
        self, batch: Batch, ended: list[tuple[int, JobRecord | None]]
    ) -> list[tuple[int, ResultLine]]:
        raws = self.store.batches.input_lines(batch.id, batch.input_file_id, [n for n, _ in ended])
        cut = BatchStatus.EXPIRED if self._expired(batch) else batch.status
        return [
            (line, self._ended_line(batch, line, batch_input.custom_id_of(raw, line), job, cut))
            for (line, job), raw in zip(ended, raws, strict=True)
        ]

    def _ended_line(
        self, batch: Batch, line: int, custom_id: str, job: JobRecord | None, cut: BatchStatus
    ) -> ResultLine:
        if job is None:  # its record expired (EXO_JOB_TTL_S) before it was collected
            error = ExoError(f"the request's job {line_job_id(batch.id, line)} is gone")
            return self.results.refused(batch, line, custom_id, error)
        return self.results.of_job(batch, line, custom_id, job, cut)

    def _write(self, batch: Batch, results: list[tuple[int, ResultLine]]) -> None:
        """Each line's result, unless it has one; each one written counted in the metrics."""
        rows = [(line, succeeded(result), result.model_dump_json()) for line, result in results]
        self._moved += len(rows)
        observations = metrics.Observations()
        for (_, ok, _), written in zip(
            rows, self.store.batches.write_results(batch.id, rows), strict=True
        ):
            if written:
                observations.inc(metrics.BATCH_REQUESTS, status="completed" if ok else "failed")
        if observations:
            self.store.metrics.write(observations)

    # --- feeding ---

    def feed(self, batch: Batch, room: Room) -> None:
        """Send the next lines the fleet has room for, side by side (each send is a few round
        trips to Redis). The cursor moves past each line in order, up to the first that has to
        wait; one sent beyond it is found (its id) when the feeder comes back to it."""
        cursor, total = self.store.batches.cursor(batch.id), batch.request_counts.total
        lines = list(range(cursor, min(total, cursor + room.left)))
        if not lines:
            return
        raws = self.store.batches.input_lines(batch.id, batch.input_file_id, lines)
        existing = self.store.jobs.records([line_job_id(batch.id, line) for line in lines])
        outcomes = list(
            self._senders.map(self._send_line, [batch] * len(lines), lines, raws, existing)
        )
        sent: list[int] = []
        refused: list[tuple[int, ResultLine]] = []
        for line, outcome in zip(lines, outcomes, strict=True):
            if outcome is None:
                break
            if outcome is SENT:
                sent.append(line)
                room.take()
            else:
                refused.append((line, outcome))
            cursor = line + 1
        self._write(batch, refused)
        if sent:  # in flight once a replica holds their jobs, as a 202 waits (docs/ha.md)
            replication.settle(self.store.redis, self.replica_wait_ms, "lines", batch_id=batch.id)
        self.store.batches.take_lines(batch.id, sent, cursor)
        self._moved += len(sent)

    def _send_line(
        self, batch: Batch, line: int, raw: str, existing: JobRecord | None
    ) -> ResultLine | Sent | None:
        """Send the line as a job (SENT; also when it was sent before the last holder died),
        or the answer its endpoint refuses it with. None: the fleet takes no job now (a full
        queue, every runner of the model down); the line waits."""
        if existing is not None:
            return SENT
        try:
            request = batch_input.read_line(raw, line)
        except batch_input.UnreadableLine as exc:
            return self.results.refused(batch, line, "", exc)
        try:
            self._submit(batch, request, line_job_id(batch.id, line))
        except (QueueFull, Unavailable):
            return None
        except (ExoError, ValidationError) as exc:
            return self.results.refused(batch, line, request.custom_id, exc)
        return SENT

    def _submit(self, batch: Batch, request: batch_input.InputLine, job_id: str) -> None:
        kind, _ = ENDPOINTS[batch.endpoint]
        json_input.check(request.body)  # as the endpoint checks a body it is sent
        context = {"max_tokens_cap": self.settings.max_tokens}
        body = kind.model_validate(request.body, context=context)
        if body.stream:
            raise InvalidRequest("a batch's requests cannot stream", {"field": "stream"})
        fields = {**body.job_fields(), "priority": "low"}
        job_request = jobs.parse_request(self.settings, fields)
        client = fairness.batch_client(batch.id)
        jobs.submit(self.store, self.app, self.settings, job_request, job_id, client=client)

    # --- ending ---

    def _expired(self, batch: Batch) -> bool:
        return batch.status == BatchStatus.IN_PROGRESS and time.time() >= batch.expires_at

    def _ended(self, batch: Batch, still: list[JobStatus]) -> bool:
        """End the batch if it is done, cancelled or past its window (its jobs in flight
        cancelled first); True if it takes no more lines."""
        stopping = batch.status == BatchStatus.CANCELLING or self._expired(batch)
        if stopping and still:
            self._cancel_inflight(batch)
            return True
        if stopping:
            expired = batch.status == BatchStatus.IN_PROGRESS
            self._end(batch, BatchStatus.EXPIRED if expired else BatchStatus.CANCELLED)
            return True
        done = self.store.batches.cursor(batch.id) >= batch.request_counts.total
        if batch.status == BatchStatus.FINALIZING or (done and not still):
            self._end(batch, BatchStatus.COMPLETED)
            return True
        return False

    def _cancel_inflight(self, batch: Batch) -> None:
        now = time.monotonic()
        if now - self._cancelled_at.get(batch.id, 0.0) >= CANCEL_EVERY_S:
            self._cancelled_at[batch.id] = now
            cancel_inflight(self.store, self.app, batch)

    def _end(self, batch: Batch, status: BatchStatus) -> None:
        now = int(time.time())
        if status == BatchStatus.COMPLETED and batch.status == BatchStatus.IN_PROGRESS:
            finalizing = lifecycle.move_batch(batch, BatchStatus.FINALIZING, now)
            if not self.store.batches.move(finalizing):
                return  # cancelled meanwhile: the next tick ends it so
            batch = finalizing.batch
        expired = status == BatchStatus.EXPIRED
        self._cut_short_the_rest(batch, BatchStatus.EXPIRED if expired else BatchStatus.CANCELLING)
        ended = lifecycle.move_batch(batch, status, now, **self._result_files(batch, now))
        self._cancelled_at.pop(batch.id, None)
        if self.store.batches.close(ended):
            log.info("batch ended", extra={"batch_id": batch.id, "status": status})

    def _cut_short_the_rest(self, batch: Batch, cut: BatchStatus) -> None:
        """Every line without a result (never sent) gets one saying why it never ran."""
        have = self.store.batches.lines_with_results(batch.id)
        missing = [line for line in range(batch.request_counts.total) if line not in have]
        for start in range(0, len(missing), 1000):
            chunk = missing[start : start + 1000]
            raws = self.store.batches.input_lines(batch.id, batch.input_file_id, chunk)
            results = [
                (
                    line,
                    self.results.never_ran(batch, line, batch_input.custom_id_of(raw, line), cut),
                )
                for line, raw in zip(chunk, raws, strict=True)
            ]
            self._write(batch, results)

    def _fail(self, batch: Batch, reason: str) -> None:
        """End the batch `failed`, `errors` giving the reason, with the results its lines have
        (never reading its input again: it may be what failed); its jobs in flight cancelled."""
        cancel_inflight(self.store, self.app, batch)
        now = int(time.time())
        errors = BatchErrors(data=[BatchError(code="batch_failed", message=reason)])
        failed = lifecycle.move_batch(
            batch, BatchStatus.FAILED, now, errors=errors, **self._result_files(batch, now)
        )
        self._cancelled_at.pop(batch.id, None)
        if self.store.batches.close(failed):
            log.warning("batch failed", extra={"batch_id": batch.id, "error": reason})

    def _result_files(self, batch: Batch, now: int) -> dict[str, object]:
        """The output and error files of the results the batch's lines have, and their counts."""
        output, errors = self.store.batches.results(batch.id)
        return {
            "output_file_id": self._file(batch, "output", output, now),
            "error_file_id": self._file(batch, "error", errors, now),
            "request_counts": RequestCounts(
                total=batch.request_counts.total, completed=len(output), failed=len(errors)
            ),
        }

    def _file(self, batch: Batch, kind: str, lines: list[str], now: int) -> str | None:
        if not lines:
            return None
        meta, content = result_file(batch, kind, lines, now)
        self.store.files.put(meta, content)
        return meta.id
