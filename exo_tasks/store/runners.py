"""Runners in Redis: each runner's state and status history, its inbox of commands, and the
jobs handed over to it (marked running and put in its inbox in one step)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis
from pydantic import TypeAdapter, ValidationError

from exo_tasks import lifecycle
from exo_tasks.commands import RunnerCommand, SubmitJob
from exo_tasks.fleet_types import RunnerState, StatusChange
from exo_tasks.store.client import NAMED_ARGS, RedisPart, ScriptCall, named, one_set
from exo_tasks.store.job_scripts import leave_waiting
from exo_tasks.store.jobs import JobRecords
from exo_tasks.store.keys import (
    DIRECT_TASKS_DUE,
    RUNNERS,
    job_key,
    runner_key,
)
from exo_tasks.wire import STORED

RUNNER_HISTORY_KEPT = 50

_command_adapter: TypeAdapter[RunnerCommand] = TypeAdapter(RunnerCommand)

# KEYS: job hash, the runner's jobs, the runner's inbox, the direct tasks due, then the jobs of
# every runner on its host (`room` > 0 only). Arguments (NAMED_ARGS): `record`, the job's as
# running; `job_id`;
# `command`, the submit command; `owner`, the worker incarnation that now owns it; `attempt`,
# the job's (its requeues so far); `runner_id`; `status`, the new one; `allowed_from`, the
# statuses it may move from (exo_tasks.lifecycle, `one_set`); `room`, the most jobs the runner
# may hold already (0: no limit), and `host_room` the most its host's runners may hold together;
# `task_due`, when the task of a job handed over directly is due (0: its task is sent anyway).
# A queued job is marked running, counted as the runner's and put in its inbox at once; a job
# no longer queued (cancelled meanwhile), or one for a runner or host without room, is left
# alone.
HAND_OVER = (
    NAMED_ARGS
    + f"""
local current = redis.call('HGET', KEYS[1], 'status')
if not one_of(current, a.allowed_from) then return 0 end
if tonumber(a.room) > 0 then
  if redis.call('SCARD', KEYS[2]) >= tonumber(a.room) then return 0 end
  local on_host = 0
  for i = 5, #KEYS do on_host = on_host + redis.call('SCARD', KEYS[i]) end
  if on_host >= tonumber(a.host_room) then return 0 end
end
{leave_waiting("a.status", "a.job_id")}
redis.call('HSET', KEYS[1], 'status', a.status, 'record', a.record)
redis.call('HSET', KEYS[1], 'owner', a.owner, 'runner', a.runner_id, 'attempt', a.attempt)
redis.call('SADD', KEYS[2], a.job_id)
redis.call('RPUSH', KEYS[3], a.command)
if tonumber(a.task_due) > 0 then redis.call('ZADD', KEYS[4], a.task_due, a.job_id) end
return 1
"""
)


@dataclass(frozen=True)
class Room:
    """The most jobs a runner (`runner`), and every runner of its host together (`host`, the
    runners `host_runners`), may hold already for one more to be handed over: a full batch,
    and its host's pool children (each job's task holds one)."""

    runner: int
    host: int
    host_runners: tuple[str, ...]


@dataclass(frozen=True)
class UnreadableCommand:
    """A message in a runner's inbox that is no valid command, and the job it names if any
    (so that job fails at once instead of waiting for a runner that dropped it)."""

    job_id: str | None
    error: str

    @classmethod
    def of(cls, raw: str, exc: ValidationError) -> UnreadableCommand:
        try:
            message = json.loads(raw)
        except (ValueError, RecursionError):
            message = None
        job_id = None
        if isinstance(message, dict):
            job = message.get("job")
            job_id = job.get("id") if isinstance(job, dict) else message.get("job_id")
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        return cls(job_id if isinstance(job_id, str) else None, problems)


@dataclass(frozen=True)
class StateWrite:
    """A runner's state published: its record, and a line of its history if its status changed.
    Alone (`RunnerRecords.publish`) or after its step's writes, in their round trip."""

    state: RunnerState
    status_changed: bool = True

    def queue_on(self, pipe: Any) -> None:
        state = self.state
        pipe.set(runner_key(state.id), state.model_dump_json())
        pipe.sadd(RUNNERS, state.id)
        if self.status_changed:
            change = StatusChange(status=state.status, at=state.updated_at, error=state.error)
            pipe.lpush(runner_key(state.id, "history"), change.model_dump_json())
            pipe.ltrim(runner_key(state.id, "history"), 0, RUNNER_HISTORY_KEPT - 1)


class RunnerRecords(RedisPart):
    """Runner states, inboxes and the jobs handed to runners (which `jobs` ends or requeues
    when their runner is gone)."""

    def __init__(self, client: redis.Redis, jobs: JobRecords) -> None:
        super().__init__(client)
        self.jobs = jobs

    def publish(self, state: RunnerState, *, status_changed: bool = True) -> None:
        pipe = self.redis.pipeline(transaction=True)
        StateWrite(state, status_changed).queue_on(pipe)
        pipe.execute()

    def get(self, runner_id: str) -> RunnerState | None:
        raw = self.redis.get(runner_key(runner_id))
        return RunnerState.model_validate_json(raw) if raw else None

    def all(self) -> list[RunnerState]:
        ids = sorted(self.redis.smembers(RUNNERS))
        raws = self.redis.mget([runner_key(i) for i in ids]) if ids else []
        return [RunnerState.model_validate_json(raw) for raw in raws if raw]

    def history(self, runner_id: str) -> list[StatusChange]:
        raws = self.redis.lrange(runner_key(runner_id, "history"), 0, -1)
        return [StatusChange.model_validate_json(raw) for raw in reversed(raws)]

    # --- a runner's inbox and the jobs handed to it ---

    def hand_over(self, runner_id: str, command: SubmitJob, room: Room | None = None) -> bool:
        """Mark a queued job running (`command.job` is its record so, naming its owner) and put
        it in the runner's inbox, in one step: the runner starts it without a write of its own.
        False if the job is no longer queued, or if the runner or its host has no `room` left
        (None: no limit)."""
        return bool(self.run(self.handing(runner_id, command, room)))

    def handing(
        self, runner_id: str, command: SubmitJob, room: Room | None = None, task_due: float = 0
    ) -> ScriptCall:
        """`hand_over`'s script call, to run with others (Store.create). `task_due`: when the
        task of a job handed over directly is due (Store.direct_tasks), 0 if it is sent anyway."""
        job = command.job
        keys = [job_key(job.id), runner_key(runner_id, "jobs"), runner_key(runner_id, "inbox")]
        keys.append(DIRECT_TASKS_DUE)
        if room is not None:
            keys += [runner_key(other, "jobs") for other in room.host_runners]
        args = named(
            record=job.model_dump_json(context=STORED),
            job_id=job.id,
            command=command.model_dump_json(context=STORED),
            owner=job.owner or "",
            attempt=job.attempts,
            runner_id=runner_id,
            status=job.status,
            allowed_from=one_set(lifecycle.HAND_OVER_FROM),
            room=room.runner if room is not None else 0,
            host_room=room.host if room is not None else 0,
            task_due=task_due,
        )
        return ScriptCall(HAND_OVER, keys, args)

    def send(self, runner_id: str, command: RunnerCommand) -> None:
        self.redis.rpush(runner_key(runner_id, "inbox"), command.model_dump_json())

    def send_each(self, commands: Iterable[tuple[str, RunnerCommand]]) -> None:
        """Commands to runners (runner id, command), in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for runner_id, command in commands:
            pipe.rpush(runner_key(runner_id, "inbox"), command.model_dump_json())
        pipe.execute()

    def next_command(
        self, runner_id: str, timeout_s: float
    ) -> RunnerCommand | UnreadableCommand | None:
        reply = self.redis.blpop([runner_key(runner_id, "inbox")], timeout=timeout_s)
        if not reply:
            return None
        try:
            return _command_adapter.validate_json(reply[1])
        except ValidationError as exc:
            return UnreadableCommand.of(reply[1], exc)

    def drop_inbox(self, runner_id: str) -> None:
        """Drop what a runner's inbox holds: commands to a life of it that has ended."""
        self.redis.delete(runner_key(runner_id, "inbox"))

    def release_job(self, runner_id: str, job_id: str) -> None:
        self.redis.srem(runner_key(runner_id, "jobs"), job_id)

    def take_jobs(self, runner_id: str) -> list[str]:
        """The jobs handed to a runner that is gone; its unread inbox is dropped."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.smembers(runner_key(runner_id, "jobs"))
        pipe.delete(runner_key(runner_id, "jobs"), runner_key(runner_id, "inbox"))
        job_ids, _ = pipe.execute()
        return sorted(job_ids)

    def fail_jobs(self, runner_id: str, error: str) -> list[str]:
        return [j for j in self.take_jobs(runner_id) if self.jobs.fail(j, error)]

    def requeue_jobs(self, runner_id: str) -> list[str]:
        return [j for j in self.take_jobs(runner_id) if self.jobs.requeue(j)]

    def job_counts(self, runner_ids: list[str]) -> list[int]:
        """How many jobs each runner holds (handed over and not yet ended)."""
        pipe = self.redis.pipeline(transaction=False)
        for runner_id in runner_ids:
            pipe.scard(runner_key(runner_id, "jobs"))
        counts: list[int] = pipe.execute()
        return counts
