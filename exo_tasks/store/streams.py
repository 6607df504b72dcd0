"""Each job's two streams, read: `events` (every token, requeue and ending, which the API's
streams and a job's progress follow) and `endings` (how each attempt ended, which the task that
handed the job over waits on). They are written with the job's moves (`exo_tasks.store.jobs`:
its state machine's script appends the ending, a runner's step the tokens); nothing here writes.
"""

from __future__ import annotations

from pydantic import TypeAdapter

from exo_tasks.fleet_types import RunnerState
from exo_tasks.store.client import RedisPart
from exo_tasks.store.keys import endings_key, events_key, runner_key
from exo_tasks.types import DoneEvent, JobEvent, RequeuedEvent, TokenEvent

_event_adapter: TypeAdapter[JobEvent] = TypeAdapter(JobEvent)
_ending_adapter: TypeAdapter[DoneEvent | RequeuedEvent] = TypeAdapter(DoneEvent | RequeuedEvent)


class JobStreams(RedisPart):
    """Reads of jobs' event and endings streams."""

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

    def event_histories(self, job_ids: list[str]) -> dict[str, list[tuple[str, JobEvent]]]:
        """The whole event stream of each job, in one round trip (progress of running jobs)."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.xrange(events_key(job_id))
        return {
            job_id: [(entry_id, _event_adapter.validate_json(f["data"])) for entry_id, f in entries]
            for job_id, entries in zip(job_ids, pipe.execute(), strict=True)
        }

    def last_event(self, job_id: str) -> tuple[str, JobEvent] | None:
        """The last event of the job's stream, if any."""
        return last_of(self.redis.xrevrange(events_key(job_id), count=1))

    def read_endings(
        self, job_id: str, after: str, block_ms: int
    ) -> list[tuple[str, DoneEvent | RequeuedEvent]]:
        """How the job's attempts ended after stream id `after`, waiting up to `block_ms`."""
        reply = self.redis.xread({endings_key(job_id): after}, block=block_ms)
        if not reply:
            return []
        _key, entries = reply[0]
        return [(entry_id, _ending_adapter.validate_json(f["data"])) for entry_id, f in entries]

    def attempt_start(self, job_id: str) -> tuple[str, int]:
        """Where a new attempt starts: the last ending's id (only later ones are this
        attempt's) and the number of events so far (later ones are this attempt's tokens)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xrevrange(endings_key(job_id), count=1)
        pipe.xlen(events_key(job_id))
        last, events = pipe.execute()
        return (str(last[0][0]) if last else "0-0"), int(events)

    def runner_and_events(self, runner_id: str, job_id: str) -> tuple[RunnerState | None, int]:
        """A runner's state and a job's event count, in one round trip (a task's check)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(runner_key(runner_id))
        pipe.xlen(events_key(job_id))
        raw, events = pipe.execute()
        return (RunnerState.model_validate_json(raw) if raw else None), int(events)

    def streamed_text(self, job_id: str) -> tuple[str, int]:
        """The text and token count of the current attempt so far (a failed job keeps it)."""
        tokens: list[str] = []
        for _, event in self.read_events(job_id):
            if isinstance(event, RequeuedEvent):
                tokens = []
            elif isinstance(event, TokenEvent):
                tokens.append(event.text)
        return "".join(tokens), len(tokens)


def last_of(entries: list[tuple[str, dict[str, str]]]) -> tuple[str, JobEvent] | None:
    """The event of an `XREVRANGE ... COUNT 1` reply, if any."""
    if not entries:
        return None
    entry_id, fields = entries[0]
    return entry_id, _event_adapter.validate_json(fields["data"])
