"""Redis: job records, each job's event stream, runner states and runner inboxes.

Every write that changes a job's status goes through one Lua script that checks the current
status first, so whoever finishes a job first (runner, task, supervisor, cancel) wins and the
others are no-ops: a job never ends twice.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis
from pydantic import TypeAdapter

from config.celery import PRIORITY_STEPS
from exo_tasks import metrics
from exo_tasks.types import (
    DoneEvent,
    HostState,
    JobEvent,
    JobRecord,
    JobStatus,
    RequeuedEvent,
    RunnerCommand,
    RunnerState,
    StatusChange,
    SupervisorRequest,
    TokenEvent,
)

PREFIX = "exo"
RECENT_JOBS_KEPT = 10_000
RUNNER_HISTORY_KEPT = 50
KOMBU_PRIORITY_SEP = "\x06\x16"
ACTIVE_STATUSES: tuple[JobStatus, ...] = ("queued", "running")

_event_adapter: TypeAdapter[JobEvent] = TypeAdapter(JobEvent)
_command_adapter: TypeAdapter[RunnerCommand] = TypeAdapter(RunnerCommand)
_supervisor_adapter: TypeAdapter[SupervisorRequest] = TypeAdapter(SupervisorRequest)

# KEYS: job hash, event stream. ARGV: new status, record, event name ('' for none), event
# data, ttl seconds (0: keep), then the statuses the job may move from.
_TRANSITION = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return 0 end
local allowed = false
for i = 6, #ARGV do
  if current == ARGV[i] then allowed = true end
end
if not allowed then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'record', ARGV[2])
if ARGV[3] ~= '' then
  redis.call('XADD', KEYS[2], '*', 'event', ARGV[3], 'data', ARGV[4])
end
local ttl = tonumber(ARGV[5])
if ttl > 0 then
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('EXPIRE', KEYS[2], ttl)
end
return 1
"""


def connect(url: str) -> redis.Redis:
    # Short connect timeout: with Redis down, callers fail fast instead of hanging.
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_connect_timeout=1.0,
        socket_timeout=10.0,
        health_check_interval=30,
    )


def job_key(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}"


def events_key(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}:events"


def runner_key(runner_id: str) -> str:
    return f"{PREFIX}:runner:{runner_id}"


def host_key(host: str) -> str:
    return f"{PREFIX}:host:{host}"


class Store:
    """Typed access to everything exo_tasks keeps in Redis."""

    def __init__(self, client: redis.Redis, *, result_ttl_s: int = 24 * 3600) -> None:
        # Any: redis-py's annotations cannot express decode_responses=True (every reply is str).
        self.redis: Any = client
        self.result_ttl_s = result_ttl_s
        self._transition = client.register_script(_TRANSITION)

    @classmethod
    def from_url(cls, url: str, *, result_ttl_s: int = 24 * 3600) -> Store:
        return cls(connect(url), result_ttl_s=result_ttl_s)

    def ping(self) -> bool:
        return bool(self.redis.ping())

    def queue_depth(self, queue: str) -> int:
        """Messages waiting in a Celery queue, across its priority lists (kombu's layout)."""
        pipe = self.redis.pipeline(transaction=False)
        for step in PRIORITY_STEPS:
            pipe.llen(f"{queue}{KOMBU_PRIORITY_SEP}{step}" if step else queue)
        return sum(pipe.execute())

    # --- jobs ---

    def create_job(self, job: JobRecord) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(job_key(job.id), mapping={"status": job.status, "record": job.model_dump_json()})
        pipe.zadd(f"{PREFIX}:jobs", {job.id: job.created_at.timestamp()})
        pipe.zremrangebyrank(f"{PREFIX}:jobs", 0, -RECENT_JOBS_KEPT - 1)
        pipe.execute()

    def get_job(self, job_id: str) -> JobRecord | None:
        raw = self.redis.hget(job_key(job_id), "record")
        return JobRecord.model_validate_json(raw) if raw else None

    def list_jobs(self, status: str | None = None, limit: int = 50) -> list[JobRecord]:
        jobs: list[JobRecord] = []
        start = 0
        while len(jobs) < limit:
            ids = self.redis.zrevrange(f"{PREFIX}:jobs", start, start + limit * 2 - 1)
            if not ids:
                break
            start += len(ids)
            raws = self._pipeline_get(ids)
            for raw in raws:
                if raw is None:
                    continue
                job = JobRecord.model_validate_json(raw)
                if status is None or job.status == status:
                    jobs.append(job)
        return jobs[:limit]

    def _pipeline_get(self, ids: Iterable[str]) -> list[str | None]:
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(job_key(job_id), "record")
        records: list[str | None] = pipe.execute()
        return records

    def transition(
        self, job: JobRecord, *, allowed_from: Iterable[str], event: JobEvent | None = None
    ) -> bool:
        """Write `job` if its stored status is one of `allowed_from`, appending `event` to its
        stream in the same step. A terminal status appends the stream's last event and starts
        the record's expiry. True if written."""
        args = self._transition_args(job, allowed_from, event)
        written = bool(self._transition(keys=[job_key(job.id), events_key(job.id)], args=args))
        if written and job.is_terminal:  # counted once: only the first ending is written
            self.write_metrics(metrics.job_ended(job))
        return written

    def _transition_args(
        self, job: JobRecord, allowed_from: Iterable[str], event: JobEvent | None
    ) -> list[str | int]:
        event_name, event_data, ttl = "", "", 0
        if job.is_terminal:
            event = DoneEvent(event="error" if job.status == "failed" else "done", job=job)
            ttl = self.result_ttl_s
        if event is not None:
            event_name, event_data = event.event, event.model_dump_json()
        args: list[str | int] = [job.status, job.model_dump_json(), event_name, event_data, ttl]
        args.extend(allowed_from)
        return args

    def write_step(
        self,
        runner_id: str,
        tokens: list[tuple[str, TokenEvent]],
        observations: metrics.Observations,
        endings: list[JobRecord],
    ) -> None:
        """A runner's step in one round trip: its tokens and metrics, then the jobs it ended
        (each written only if still active: first writer wins) and their release. The ended
        jobs' metrics follow, for the endings that were written. One transaction: a reader
        blocked on a job's stream wakes once, with the step's token and the job's end together."""
        pipe = self.redis.pipeline(transaction=True)
        for job_id, token in tokens:
            pipe.xadd(events_key(job_id), {"event": token.event, "data": token.model_dump_json()})
        observations.write(pipe)
        for job in endings:
            # EVAL, not the registered script's EVALSHA: a pipeline would first ask whether the
            # script is loaded, one more round trip each time.
            args = self._transition_args(job, ACTIVE_STATUSES, None)
            pipe.eval(_TRANSITION, 2, job_key(job.id), events_key(job.id), *args)
            pipe.srem(f"{runner_key(runner_id)}:jobs", job.id)
        replies = pipe.execute()
        observations.clear()
        written = replies[len(replies) - 2 * len(endings) :: 2]
        ended = [metrics.job_ended(job) for job, ok in zip(endings, written, strict=True) if ok]
        if ended:
            pipe = self.redis.pipeline(transaction=False)
            for counts in ended:
                counts.write(pipe)
            pipe.execute()

    def finish_job(self, job: JobRecord) -> bool:
        """Move an active job to its terminal status (first writer wins)."""
        assert job.is_terminal, job.status
        return self.transition(job, allowed_from=ACTIVE_STATUSES)

    def fail_job(self, job_id: str, error: str) -> bool:
        job = self.get_job(job_id)
        if job is None or job.is_terminal:
            return False
        text, tokens = self.streamed_text(job_id)
        return self.finish_job(
            job.finished(
                "failed", text=text, finish_reason=None, completion_tokens=tokens, error=error
            )
        )

    def requeue_job(self, job_id: str) -> bool:
        """Put an unfinished job back to `queued` for another attempt (its worker stopped)."""
        job = self.get_job(job_id)
        if job is None or job.is_terminal:
            return False
        attempt = job.attempts + 1
        fresh = JobRecord(
            id=job.id,
            model=job.model,
            request=job.request,
            created_at=job.created_at,
            attempts=attempt,
        )
        return self.transition(
            fresh, allowed_from=ACTIVE_STATUSES, event=RequeuedEvent(attempt=attempt)
        )

    # --- a job's event stream ---

    def read_events(
        self, job_id: str, after: str = "0-0", block_ms: int | None = None
    ) -> list[tuple[str, JobEvent]]:
        """Events after stream id `after`, waiting up to `block_ms` for the first one."""
        reply = self.redis.xread({events_key(job_id): after}, block=block_ms)
        if not reply:
            return []
        _key, entries = reply[0]
        return [
            (entry_id, _event_adapter.validate_json(fields["data"])) for entry_id, fields in entries
        ]

    def last_event_id(self, job_id: str) -> str:
        """The stream position to follow a job from: only what happens next is read."""
        last = self.redis.xrevrange(events_key(job_id), count=1)
        return str(last[0][0]) if last else "0-0"

    def streamed_text(self, job_id: str) -> tuple[str, int]:
        """The text and token count of the current attempt so far (a failed job keeps it)."""
        tokens: list[str] = []
        for _, event in self.read_events(job_id):
            if isinstance(event, RequeuedEvent):
                tokens = []
            elif isinstance(event, TokenEvent):
                tokens.append(event.text)
        return "".join(tokens), len(tokens)

    # --- runners ---

    def publish_runner(self, state: RunnerState, *, status_changed: bool = True) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(runner_key(state.id), state.model_dump_json())
        pipe.sadd(f"{PREFIX}:runners", state.id)
        if status_changed:
            change = StatusChange(status=state.status, at=state.updated_at, error=state.error)
            pipe.lpush(f"{runner_key(state.id)}:history", change.model_dump_json())
            pipe.ltrim(f"{runner_key(state.id)}:history", 0, RUNNER_HISTORY_KEPT - 1)
        pipe.execute()

    def get_runner(self, runner_id: str) -> RunnerState | None:
        raw = self.redis.get(runner_key(runner_id))
        return RunnerState.model_validate_json(raw) if raw else None

    def list_runners(self) -> list[RunnerState]:
        ids = sorted(self.redis.smembers(f"{PREFIX}:runners"))
        raws = self.redis.mget([runner_key(i) for i in ids]) if ids else []
        return [RunnerState.model_validate_json(raw) for raw in raws if raw]

    def runner_history(self, runner_id: str) -> list[StatusChange]:
        raws = self.redis.lrange(f"{runner_key(runner_id)}:history", 0, -1)
        return [StatusChange.model_validate_json(raw) for raw in reversed(raws)]

    # --- a runner's inbox and the jobs handed to it ---

    def send_to_runner(self, runner_id: str, command: RunnerCommand) -> None:
        pipe = self.redis.pipeline(transaction=True)
        if command.kind == "submit":
            pipe.sadd(f"{runner_key(runner_id)}:jobs", command.job_id)
        pipe.rpush(f"{runner_key(runner_id)}:inbox", command.model_dump_json())
        pipe.execute()

    def next_runner_command(self, runner_id: str, timeout_s: float) -> RunnerCommand | None:
        reply = self.redis.blpop([f"{runner_key(runner_id)}:inbox"], timeout=timeout_s)
        return _command_adapter.validate_json(reply[1]) if reply else None

    def release_job(self, runner_id: str, job_id: str) -> None:
        self.redis.srem(f"{runner_key(runner_id)}:jobs", job_id)

    def take_runner_jobs(self, runner_id: str) -> list[str]:
        """The jobs handed to a runner that is gone; its unread inbox is dropped."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.smembers(f"{runner_key(runner_id)}:jobs")
        pipe.delete(f"{runner_key(runner_id)}:jobs", f"{runner_key(runner_id)}:inbox")
        job_ids, _ = pipe.execute()
        return sorted(job_ids)

    def fail_runner_jobs(self, runner_id: str, error: str) -> list[str]:
        return [j for j in self.take_runner_jobs(runner_id) if self.fail_job(j, error)]

    def requeue_runner_jobs(self, runner_id: str) -> list[str]:
        return [j for j in self.take_runner_jobs(runner_id) if self.requeue_job(j)]

    def jobs_on_runners(self, runner_ids: list[str]) -> list[int]:
        """How many jobs each runner holds (handed over and not yet ended)."""
        pipe = self.redis.pipeline(transaction=False)
        for runner_id in runner_ids:
            pipe.scard(f"{runner_key(runner_id)}:jobs")
        counts: list[int] = pipe.execute()
        return counts

    # --- live hosts (each worker's expiring heartbeat) ---

    def publish_host(self, state: HostState, ttl_s: float) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(host_key(state.name), state.model_dump_json(), px=int(ttl_s * 1000))
        pipe.sadd(f"{PREFIX}:hosts", state.name)
        pipe.execute()

    def remove_host(self, host: str) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(host_key(host))
        pipe.srem(f"{PREFIX}:hosts", host)
        pipe.execute()

    def fleet(self) -> tuple[list[HostState], list[RunnerState]]:
        """The hosts whose heartbeat has not expired (expired ones are forgotten) and every
        runner, in two round trips: the API reads both for every job it takes."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.smembers(f"{PREFIX}:hosts")
        pipe.smembers(f"{PREFIX}:runners")
        names, runner_ids = (sorted(members) for members in pipe.execute())
        keys = [host_key(n) for n in names] + [runner_key(i) for i in runner_ids]
        raws = self.redis.mget(keys) if keys else []
        host_raws, runner_raws = raws[: len(names)], raws[len(names) :]
        gone = [name for name, raw in zip(names, host_raws, strict=True) if raw is None]
        if gone:
            self.redis.srem(f"{PREFIX}:hosts", *gone)
        hosts = [HostState.model_validate_json(raw) for raw in host_raws if raw]
        return hosts, [RunnerState.model_validate_json(raw) for raw in runner_raws if raw]

    # --- metrics ---

    def write_metrics(self, observations: metrics.Observations) -> None:
        pipe = self.redis.pipeline(transaction=False)
        observations.write(pipe)
        pipe.execute()
        observations.clear()

    def read_metrics(self) -> dict[str, dict[str, str]]:
        """Every stored metric's hash, by metric name."""
        pipe = self.redis.pipeline(transaction=False)
        for metric in metrics.STORED:
            pipe.hgetall(metric.key)
        return {m.name: stored for m, stored in zip(metrics.STORED, pipe.execute(), strict=True)}

    # --- a host's supervisor inbox ---

    def send_to_supervisor(self, host: str, request: SupervisorRequest) -> None:
        self.redis.rpush(f"{PREFIX}:supervisor:{host}", request.model_dump_json())

    def next_supervisor_request(self, host: str, timeout_s: float) -> SupervisorRequest | None:
        reply = self.redis.blpop([f"{PREFIX}:supervisor:{host}"], timeout=timeout_s)
        return _supervisor_adapter.validate_json(reply[1]) if reply else None
