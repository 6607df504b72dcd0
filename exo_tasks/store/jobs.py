"""Job records, and the execution of the job state machine's moves (exo_tasks.lifecycle),
which append to each job's streams (read by `exo_tasks.store.streams`).

Every write that changes a job's status goes through one Lua script that checks the current
status first, so whoever ends a job first (runner, task, supervisor, cancel) wins and the
others are no-ops: a job never ends twice.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import redis
from pydantic import ValidationError

from config.celery import PRIORITY_CLASSES
from exo_tasks import fairness, lifecycle, metrics
from exo_tasks.broker import WITHDRAW, queue_lists
from exo_tasks.fleet_types import RunnerState
from exo_tasks.store.client import Arg, PipelineWrite, RedisPart, ScriptCall, named, one_set
from exo_tasks.store.hosts import PrefixHint
from exo_tasks.store.job_scripts import CREATE_UNLESS_FULL, TRANSITION
from exo_tasks.store.keys import (
    ACTIVE_JOBS,
    RECENT_JOBS,
    client_key,
    events_key,
    job_key,
    runner_key,
    transition_keys,
)
from exo_tasks.store.streams import JobStreams, last_of
from exo_tasks.types import (
    DoneEvent,
    FinishReason,
    JobEnding,
    JobEvent,
    JobRecord,
    JobStatus,
    TokenEvent,
)
from exo_tasks.wire import STORED

log = logging.getLogger("exo_tasks.store")


@dataclass(frozen=True)
class Admission:
    """What a job's creation found: the messages waiting in its queue, its client's jobs
    waiting (all classes), and the priority step it was given (None: not created, the queue
    or the client's quota was full)."""

    depth: int
    client_waiting: int
    step: int | None

    @classmethod
    def of(cls, reply: list[int]) -> Admission:
        """From the creation script's reply (a step of -1: not created)."""
        depth, waiting, step = reply
        return cls(int(depth), int(waiting), None if step < 0 else int(step))


@dataclass(frozen=True)
class JobWhereabouts:
    """Where an active job is: the queue its message goes to and, once running, the worker
    incarnation that owns it, the runner that has it and the attempt (None: handed over before
    attempts were recorded here)."""

    id: str
    status: JobStatus
    queue: str
    owner: str | None
    runner_id: str | None
    attempt: int | None = None


class JobRecords(RedisPart):
    """Job records and their moves; each ending is counted in the metrics as it is written, and
    an ending from outside its runner keeps the text `streams` had of it. A job's keys expire
    `job_ttl_s` after its last move."""

    def __init__(self, client: redis.Redis, streams: JobStreams, *, job_ttl_s: int) -> None:
        super().__init__(client)
        self.streams = streams
        self.job_ttl_s = job_ttl_s

    def queue_depth(self, queue: str) -> int:
        """Messages waiting in a Celery queue, across its priority lists (kombu's layout)."""
        pipe = self.redis.pipeline(transaction=False)
        for key in queue_lists(queue):
            pipe.llen(key)
        return sum(pipe.execute())

    def create(
        self, job: JobRecord, queue: str, max_queued: int, client: str | None = None, quota: int = 0
    ) -> Admission:
        """Record a new job unless `queue` holds `max_queued` messages already or `client`
        (a fairness.Client key; None: counted nowhere) has `quota` jobs waiting, in one round
        trip, and give it its priority step (exo_tasks.fairness)."""
        return Admission.of(self.run(self.creation(job, queue, max_queued, client, quota)))

    def creation(
        self, job: JobRecord, queue: str, max_queued: int, client: str | None = None, quota: int = 0
    ) -> ScriptCall:
        """`create`'s script call, to run with others (Store.create)."""
        priority = job.request.priority
        classes = sorted(PRIORITY_CLASSES, key=lambda name: name != priority)
        sets = [client_key(client, name) for name in classes] if client else []
        keys = [job_key(job.id), RECENT_JOBS, ACTIVE_JOBS, *sets, *queue_lists(queue)]
        created = job.created_at.timestamp()
        args = named(
            max_queued=max_queued,
            status=job.status,
            record=job.model_dump_json(context=STORED),
            created_at=created,
            job_id=job.id,
            ttl=self.job_ttl_s,
            queue=queue,
            sets=len(sets),
            quota=quota,
            oldest=created - self.job_ttl_s,
            steps=one_set(fairness.step_table(priority)),
        )
        return ScriptCall(CREATE_UNLESS_FULL, keys, args)

    def client_waiting(self, client: str) -> int:
        """The jobs `client` has waiting, all priority classes."""
        pipe = self.redis.pipeline(transaction=False)
        for name in PRIORITY_CLASSES:
            pipe.zcard(client_key(client, name))
        return sum(pipe.execute())

    def queue_priority(self, job_id: str) -> int | None:
        """The priority step a job was given when it was created (None before steps were)."""
        raw = self.redis.hget(job_key(job_id), "priority")
        return int(raw) if raw is not None else None

    def get(self, job_id: str) -> JobRecord | None:
        raw = self.redis.hget(job_key(job_id), "record")
        return JobRecord.model_validate_json(raw) if raw else None

    def final(self, job: JobRecord, done: DoneEvent) -> JobEnding:
        """`job` (as read before it ended) whole as `done` ended it: its ending with its
        request (a job's request never changes: its record is not read again), or, if it asked
        for logprobs, which only its record keeps, its record (as its ending has it if the
        record is gone)."""
        if job.request.logprobs:
            return self.get(done.job.id) or done.job
        return JobRecord.model_construct(**dict(done.job), request=job.request)

    def with_last_event(self, job_id: str) -> tuple[JobRecord | None, tuple[str, JobEvent] | None]:
        """A job and the last event of its stream, in one round trip (a stream's opening)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hget(job_key(job_id), "record")
        pipe.xrevrange(events_key(job_id), count=1)
        raw, entries = pipe.execute()
        return (JobRecord.model_validate_json(raw) if raw else None), last_of(entries)

    def with_runner(
        self, job_id: str, runner_id: str
    ) -> tuple[JobRecord | None, RunnerState | None]:
        """A job and the runner that would take it, in one round trip (a task's first step)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hget(job_key(job_id), "record")
        pipe.get(runner_key(runner_id))
        job_raw, runner_raw = pipe.execute()
        job = JobRecord.model_validate_json(job_raw) if job_raw else None
        return job, RunnerState.model_validate_json(runner_raw) if runner_raw else None

    def recent(
        self, status: str | None = None, limit: int = 50, before: str | None = None
    ) -> list[JobRecord] | None:
        """Recent jobs, newest first, from the one after job `before` if given (None if that
        job is not among the recent ones). Queued or running ones are looked for among the
        active jobs alone, not in every recent record (up to RECENT_JOBS_KEPT of them)."""
        jobs: list[JobRecord] = []
        start = self.start_after(RECENT_JOBS, before)
        if start is None:
            return None
        active = status is not None and not JobStatus(status).is_terminal
        pages = self._active_pages if active else self._recent_pages
        for ids in pages(start, limit * 2):
            if len(jobs) >= limit:
                break
            for job_id, raw in zip(ids, self._raw_records(ids), strict=True):
                if raw is None:
                    continue
                try:
                    job = JobRecord.model_validate_json(raw)
                except ValidationError:  # stored before a rule tightened: not the list's loss
                    log.warning("unreadable job record skipped", extra={"job_id": job_id})
                    continue
                if status is None or job.status == status:
                    jobs.append(job)
        return jobs[:limit]

    def _recent_pages(self, start: int, size: int) -> Iterator[list[str]]:
        """The recent jobs' ids from rank `start` of the newest-first index, `size` at a time."""
        while ids := self.redis.zrevrange(RECENT_JOBS, start, start + size - 1):
            yield ids
            start += len(ids)

    def _active_pages(self, start: int, size: int) -> Iterator[list[str]]:
        """The active jobs' ids from rank `start` of the same index, in its order, `size` at a
        time."""
        ids = list(self.redis.smembers(ACTIVE_JOBS))
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.zrevrank(RECENT_JOBS, job_id)
        # A job gone from the index (past RECENT_JOBS_KEPT newer ones) has no rank: not listed.
        ranked = [(r, j) for r, j in zip(pipe.execute(), ids, strict=True) if r is not None]
        ordered = [j for r, j in sorted(ranked) if r >= start]
        for at in range(0, len(ordered), size):
            yield ordered[at : at + size]

    def records(self, job_ids: Iterable[str]) -> list[JobRecord | None]:
        """Jobs' records in one round trip."""
        raws = self._raw_records(job_ids)
        return [JobRecord.model_validate_json(raw) if raw else None for raw in raws]

    def _raw_records(self, job_ids: Iterable[str]) -> list[str | None]:
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(job_key(job_id), "record")
        records: list[str | None] = pipe.execute()
        return records

    def apply(self, move: lifecycle.Move) -> bool:
        """Execute one move of the job state machine (compare-and-set on the stored status, and
        on the owner when the move names one). A terminal record appends the stream's last
        event. The record and its streams expire EXO_JOB_TTL_S after the last move. True if
        written."""
        args = self._transition_args(move)
        return bool(self.script(TRANSITION)(keys=transition_keys(move.record.id), args=args))

    def _transition_args(self, move: lifecycle.Move) -> list[Arg]:
        job, event = move.record, move.event
        event_name, event_data = "", ""
        if job.is_terminal:
            # Its request and logprobs are kept in its record only (`final` reads them there).
            output = job.output.model_copy(update={"logprobs": None})
            event = DoneEvent(
                event=lifecycle.ending_event(job), job=job.model_copy(update={"output": output})
            )
        if event is not None:
            event_name, event_data = event.event, event.model_dump_json(context=STORED)
        return named(
            status=job.status,
            record=job.model_dump_json(context=STORED),
            event=event_name,
            data=event_data,
            ttl=self.job_ttl_s,
            only_owner=move.owner or "",
            owner=job.owner or "",
            job_id=job.id,
            allowed_from=one_set(move.allowed_from),
            # An ending's metrics, counted only by the first ending written (first writer wins).
            counts=metrics.job_ended(job).as_argument() if job.is_terminal else "",
        )

    def write_step(
        self,
        runner_id: str,
        tokens: list[tuple[str, TokenEvent]],
        observations: metrics.Observations,
        endings: list[JobRecord],
        hints: list[PrefixHint],
        mark: str,
        after: Sequence[PipelineWrite] = (),
    ) -> None:
        """A runner's step in one round trip: its tokens and metrics, the prompt prefixes its
        succeeded jobs left in its cache, then the jobs it ended (each written, with its
        metrics, only if still active: first writer wins) and their release, then `after`
        (the runner's state, which follows its jobs). One transaction: a reader blocked on a
        job's stream wakes once, with the step's token and the job's end together, a job read
        as ended is counted, and a conversation's next turn sent as its last one ends already
        finds its prefixes' host. `mark` is written with it: `step_written` tells whether a
        write that failed landed."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(runner_key(runner_id, "step"), mark, ex=self.job_ttl_s)
        for job_id, token in tokens:
            data = token.model_dump_json(context=STORED)
            pipe.xadd(events_key(job_id), {"event": token.event, "data": data})
            # An attempt's first token: the stream expires even if the job never ends.
            if token.index == 0:
                pipe.expire(events_key(job_id), self.job_ttl_s)
        observations.write(pipe)
        for hint in hints:
            hint.write(pipe)
        for job in endings:
            # EVAL, not EVALSHA: a pipeline would first ask if the script is loaded (a round trip).
            args = self._transition_args(lifecycle.write_ending(job))
            pipe.eval(TRANSITION, 4, *transition_keys(job.id), *args)
            pipe.srem(runner_key(runner_id, "jobs"), job.id)
        for write in after:
            write.queue_on(pipe)
        pipe.execute()
        observations.clear()

    def step_written(self, runner_id: str, mark: str) -> bool:
        """Whether the runner's step write marked `mark` is in Redis (its last one, then)."""
        return bool(self.redis.get(runner_key(runner_id, "step")) == mark)

    def end(
        self,
        job_id: str,
        status: JobStatus,
        *,
        finish_reason: FinishReason | None = None,
        error: str | None = None,
    ) -> bool:
        """End an active job from outside its runner, with the text its current attempt
        streamed so far (first writer wins). True if this call ended it."""
        job = self.get(job_id)
        if job is None or job.is_terminal:
            return False
        text, tokens = self.streams.streamed_text(job_id)
        move = lifecycle.end(
            job,
            status,
            text=text,
            finish_reason=finish_reason,
            completion_tokens=tokens,
            error=error,
        )
        return self.apply(move)

    def fail(self, job_id: str, error: str) -> bool:
        return self.end(job_id, JobStatus.FAILED, error=error)

    def requeue(
        self, job_id: str, *, only_from: str | None = None, only_attempt: int | None = None
    ) -> JobRecord | None:
        """Put an unfinished job back to `queued` for another attempt (its worker stopped or
        died); `only_from`: only while that worker incarnation still owns it (and, with
        `only_attempt`, still in that attempt). A job whose cancel was accepted ends
        `cancelled` instead: a cancel is final. Returns the record as requeued, or None if the
        job had ended or moved on."""
        job = self.get(job_id)
        if job is None or job.is_terminal or (only_from is not None and job.owner != only_from):
            return None
        if only_attempt is not None and job.attempts != only_attempt:
            return None
        if self.redis.hexists(job_key(job_id), "cancel"):
            text, tokens = self.streams.streamed_text(job_id)
            self.apply(lifecycle.cancel_orphaned(job, text, tokens))
            return None
        move = lifecycle.requeue(job, only_from_owner=only_from is not None)
        return move.record if self.apply(move) else None

    def set_queue(self, job_id: str, queue: str) -> None:
        """Record the queue a job's message was sent to anew (jobs.resend)."""
        self.redis.hset(job_key(job_id), "queue", queue)

    def request_cancel(self, job_id: str, by: str) -> None:
        """Remember that a running job's cancel was accepted, so that no later attempt runs it
        if its worker dies before the runner ends it; and who asked first (`by`, for Flower)."""
        self.redis.hsetnx(job_key(job_id), "cancel", by)

    def withdraw_message(self, job_id: str) -> bool:
        """Drop the job's message from the queue it waits in (a job that will never run: its
        message would count as waiting until a worker took it). False if none waits there."""
        queue = self.redis.hget(job_key(job_id), "queue")
        if not queue:
            return False
        return bool(self.script(WITHDRAW)(keys=queue_lists(queue), args=[job_id]))

    def cancel_reason(self, job_id: str) -> str | None:
        """Who cancelled the job first (request_cancel), None if nobody did."""
        reason: str | None = self.redis.hget(job_key(job_id), "cancel")
        return reason

    def active(self) -> list[JobWhereabouts]:
        """Every job queued or running, wherever it is: its status and whereabouts only (the
        recovery loop reads this every sweep; records can hold megabytes of prompt)."""
        ids = sorted(self.redis.smembers(ACTIVE_JOBS))
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(job_key(job_id), "status", "queue", "owner", "runner", "attempt")
        return [
            JobWhereabouts(
                job_id,
                JobStatus(status),
                queue or "",
                owner or None,
                runner or None,
                None if attempt is None else int(attempt),
            )
            for job_id, (status, queue, owner, runner, attempt) in zip(
                ids, pipe.execute(), strict=True
            )
            if status in lifecycle.ACTIVE
        ]
