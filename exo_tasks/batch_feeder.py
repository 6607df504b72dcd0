"""The batch feeder: drives every open batch, from validation to its output files.

It runs in a worker's main process, in one worker at a time (a lease in Redis, taken over
within seconds when its holder dies), and keeps nothing in memory that Redis does not have: a
feeder that was killed anywhere is continued by the next holder, and every step is one it can
repeat. A line runs as a job whose id follows from the line (exo_tasks.batch_results), sent
at `low` priority only while the fleet has room: at most EXO_BATCH_MAX_QUEUED batch jobs
waiting in the queues and EXO_BATCH_INFLIGHT_PER_HOST per live host at all, so interactive
jobs never wait behind a batch. A line's result is written once (exo_tasks.store.batches).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from pydantic import ValidationError

from exo_tasks import batch_input, jobs, metrics
from exo_tasks.batch_jobs import cancel_inflight, line_job_id
from exo_tasks.batch_results import ENDPOINTS, LineResults, succeeded
from exo_tasks.batch_types import (
    Batch,
    BatchErrors,
    BatchStatus,
    FileObject,
    RequestCounts,
    ResultLine,
)
from exo_tasks.celery_app import ExoCelery
from exo_tasks.errors import ExoError, InvalidRequest, QueueFull, Unavailable
from exo_tasks.store.keys import BATCH_FEEDER_LEASE
from exo_tasks.types import JobStatus

log = logging.getLogger("exo_tasks.batches")
TICK_S = 0.1
LEASE_TTL_S = 5.0
# A batch being cancelled or past its window: its jobs in flight are asked to stop this often
# until they have all ended (the API's cancel asks at once).
CANCEL_EVERY_S = 1.0


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
        self.holder = holder
        self.results = LineResults()
        self._closing = threading.Event()
        self._cancelled_at: dict[str, float] = {}

    def start(self) -> None:
        threading.Thread(target=self._run, name="batch-feeder", daemon=True).start()

    def stop(self) -> None:
        self._closing.set()

    def _run(self) -> None:
        while not self._closing.wait(TICK_S):
            try:
                if self.store.hold_lease(self.holder, LEASE_TTL_S, BATCH_FEEDER_LEASE):
                    self.tick()
            except Exception:  # Redis down, say: the loop must outlive it
                log.exception("batch feeder tick failed; retrying")

    def tick(self) -> None:
        batches = [b for b in map(self.store.get_batch, self.store.open_batches()) if b]
        hosts = max(1, len(self.store.fleet()[0]))
        room = Room(self.settings.batch_inflight_per_host * hosts, self.settings.batch_max_queued)
        running: list[Batch] = []
        for batch in batches:
            if batch.status == "validating":
                self.validate(batch)
                continue
            still = self.collect(batch)
            room.inflight -= len(still)
            room.queued -= sum(status == JobStatus.QUEUED for status in still)
            if not self._ended(batch, still):
                running.append(batch)
        for batch in running:
            self.feed(batch, room)

    # --- validating ---

    def validate(self, batch: Batch) -> None:
        content = self.store.file_content(batch.input_file_id)
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
            update = {"status": "failed", "failed_at": now, "errors": errors}
            self.store.close_batch(batch.model_copy(update=update), "validating")
            return
        self.store.set_spans(batch.id, checked.spans)
        counts = RequestCounts(total=len(checked.spans))
        update = {"status": "in_progress", "in_progress_at": now, "request_counts": counts}
        self.store.move_batch(batch.model_copy(update=update), "validating")

    # --- collecting the jobs that ended ---

    def collect(self, batch: Batch) -> list[JobStatus]:
        """Write the result of each of the batch's jobs that ended; the statuses of the rest."""
        lines = self.store.inflight(batch.id)
        found = [(line, self.store.get_job(line_job_id(batch.id, line))) for line in lines]
        ended = [(line, job) for line, job in found if job is None or job.is_terminal]
        if ended:
            raws = self.store.input_lines(batch.id, batch.input_file_id, [n for n, _ in ended])
            cut = "expired" if self._expired(batch) else batch.status
            for (line, job), raw in zip(ended, raws, strict=True):
                custom_id = batch_input.read_line(raw).custom_id
                if job is None:  # its record expired (EXO_JOB_TTL_S) before it was collected
                    error = ExoError(f"the request's job {line_job_id(batch.id, line)} is gone")
                    result = self.results.refused(batch, line, custom_id, error)
                else:
                    result = self.results.of_job(batch, line, custom_id, job, cut)
                self._write(batch, line, result)
        return [job.status for _, job in found if job is not None and not job.is_terminal]

    def _write(self, batch: Batch, line: int, result: ResultLine) -> None:
        ok = succeeded(result)
        if self.store.write_result(batch.id, line, ok, result.model_dump_json()):
            observations = metrics.Observations()
            observations.inc(metrics.BATCH_REQUESTS, status="completed" if ok else "failed")
            self.store.write_metrics(observations)

    # --- feeding ---

    def feed(self, batch: Batch, room: Room) -> None:
        cursor, total = self.store.cursor(batch.id), batch.request_counts.total
        lines = list(range(cursor, min(total, cursor + room.left)))
        if not lines:
            return
        raws = self.store.input_lines(batch.id, batch.input_file_id, lines)
        for line, raw in zip(lines, raws, strict=True):
            if not self._feed_line(batch, line, batch_input.read_line(raw)):
                return
            room.take()

    def _feed_line(self, batch: Batch, line: int, request: batch_input.InputLine) -> bool:
        """Send the line as a job, or write why its endpoint refuses it. False: the fleet takes
        no job now (a full queue, every runner of the model down); the line waits."""
        job_id = line_job_id(batch.id, line)
        if self.store.get_job(job_id) is not None:  # sent before the last holder died
            self.store.take_line(batch.id, line, as_job=True)
            return True
        try:
            self._submit(batch, request, job_id)
        except (QueueFull, Unavailable):
            return False
        except (ExoError, ValidationError) as exc:
            self._write(batch, line, self.results.refused(batch, line, request.custom_id, exc))
            self.store.take_line(batch.id, line, as_job=False)
            return True
        self.store.take_line(batch.id, line, as_job=True)
        return True

    def _submit(self, batch: Batch, request: batch_input.InputLine, job_id: str) -> None:
        kind, _ = ENDPOINTS[batch.endpoint]
        context = {"max_tokens_cap": self.settings.max_tokens}
        body = kind.model_validate(request.body, context=context)
        if body.stream:
            raise InvalidRequest("a batch's requests cannot stream", {"field": "stream"})
        fields = {**body.job_fields(), "priority": "low"}
        job_request = jobs.parse_request(self.settings, fields)
        jobs.submit(self.store, self.app, self.settings, job_request, job_id=job_id)

    # --- ending ---

    def _expired(self, batch: Batch) -> bool:
        return batch.status == "in_progress" and time.time() >= batch.expires_at

    def _ended(self, batch: Batch, still: list[JobStatus]) -> bool:
        """End the batch if it is done, cancelled or past its window (its jobs in flight
        cancelled first); True if it takes no more lines."""
        stopping = batch.status == "cancelling" or self._expired(batch)
        if stopping and still:
            self._cancel_inflight(batch)
            return True
        if stopping:
            self._end(batch, "expired" if batch.status == "in_progress" else "cancelled")
            return True
        done = self.store.cursor(batch.id) >= batch.request_counts.total
        if batch.status == "finalizing" or (done and not still):
            self._end(batch, "completed")
            return True
        return False

    def _cancel_inflight(self, batch: Batch) -> None:
        now = time.monotonic()
        if now - self._cancelled_at.get(batch.id, 0.0) >= CANCEL_EVERY_S:
            self._cancelled_at[batch.id] = now
            cancel_inflight(self.store, batch)

    def _end(self, batch: Batch, status: BatchStatus) -> None:
        now = int(time.time())
        previous: BatchStatus = batch.status
        if status == "completed" and batch.status == "in_progress":
            finalizing = batch.model_copy(update={"status": "finalizing", "finalizing_at": now})
            if not self.store.move_batch(finalizing, "in_progress"):
                return  # cancelled meanwhile: the next tick ends it so
            batch, previous = finalizing, "finalizing"
        self._cut_short_the_rest(batch, "expired" if status == "expired" else "cancelling")
        output, errors = self.store.results(batch.id)
        update: dict[str, object] = {
            "status": status,
            f"{status}_at": now,
            "output_file_id": self._file(batch, "output", output, now),
            "error_file_id": self._file(batch, "error", errors, now),
            "request_counts": RequestCounts(
                total=batch.request_counts.total, completed=len(output), failed=len(errors)
            ),
        }
        self._cancelled_at.pop(batch.id, None)
        if self.store.close_batch(batch.model_copy(update=update), previous):
            log.info("batch ended", extra={"batch_id": batch.id, "status": status})

    def _cut_short_the_rest(self, batch: Batch, cut: str) -> None:
        """Every line without a result (never sent) gets one saying why it never ran."""
        have = self.store.lines_with_results(batch.id)
        missing = [line for line in range(batch.request_counts.total) if line not in have]
        for start in range(0, len(missing), 1000):
            chunk = missing[start : start + 1000]
            raws = self.store.input_lines(batch.id, batch.input_file_id, chunk)
            for line, raw in zip(chunk, raws, strict=True):
                custom_id = batch_input.read_line(raw).custom_id
                self._write(batch, line, self.results.never_ran(batch, line, custom_id, cut))

    def _file(self, batch: Batch, kind: str, lines: list[str], now: int) -> str | None:
        if not lines:
            return None
        content = "".join(line + "\n" for line in lines)
        meta = FileObject(
            id=f"file-{batch.id.removeprefix('batch_')}-{kind}",
            bytes=len(content.encode()),
            created_at=now,
            filename=f"{batch.id}_{kind}.jsonl",
            purpose="batch_output",
        )
        self.store.put_file(meta, content)
        return meta.id
