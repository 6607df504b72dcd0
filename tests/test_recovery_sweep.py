"""The recovery loop's own steps on a real redis-server, without workers: what one sweep puts in
the runners' inboxes, and the order in which a restarted worker recovers what its previous
incarnation held."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from exo_tasks import broker, lifecycle
from exo_tasks.broker import Broker
from exo_tasks.celery_app import ExoCelery
from exo_tasks.commands import CheckJobs, JobCheck, RunnerCommand, SubmitJob
from exo_tasks.fleet_types import HostState
from exo_tasks.recovery import HEARTBEAT_TTL_S, Recovery
from exo_tasks.store import Store
from exo_tasks.store.keys import runner_key
from exo_tasks.types import JobRecord, JobRequest, JobStatus, utcnow
from tests.support.api import api_settings
from tests.support.processes import RedisServer

commands: TypeAdapter[RunnerCommand] = TypeAdapter(RunnerCommand)


@pytest.fixture(scope="module")
def celery(redis_server: RedisServer, tiny_model: Path) -> Iterator[ExoCelery]:
    app = ExoCelery(api_settings(redis_server.url, [tiny_model]))
    yield app
    app.close()


class Host:
    """A host of a test's own on the session's Redis, and what the test put there: taken out
    at its end, so that no later sweep of the session finds it."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.name = f"sweep-{uuid.uuid4().hex[:6]}"
        self.queue = f"exo.model.{self.name}"  # a queue nobody consumes
        self.jobs: list[str] = []
        self.runners: set[str] = set()

    def incarnation(self, n: int) -> str:
        return f"{self.name}:{n}:{n}"

    def state(self, incarnation: str, held: list[str]) -> HostState:
        return HostState(
            name=self.name,
            pid=1,
            incarnation=incarnation,
            models=[],
            held=held,
            started_at=utcnow(),
        )

    def running(self, runner_id: str, owner: str) -> JobRecord:
        """A job created, then marked running on `runner_id` under `owner`, as a task does."""
        request = JobRequest.model_validate({"prompt": "x", "max_tokens": 4})
        job = JobRecord(id=uuid.uuid4().hex, model="tiny", request=request)
        self.store.jobs.create(job, self.queue, max_queued=1_000)
        self.jobs.append(job.id)
        self.runners.add(runner_id)
        started = lifecycle.start(job, host=self.name, runner_id=runner_id, owner=owner)
        deadline = time.time() + 60
        command = SubmitJob(job=started, soft_deadline=deadline, deadline=deadline)
        assert self.store.runners.hand_over(runner_id, command)
        return started

    def inbox(self, runner_id: str) -> list[str]:
        inbox: list[str] = self.store.redis.lrange(runner_key(runner_id, "inbox"), 0, -1)
        return inbox

    def clear_inboxes(self) -> None:
        self.store.redis.delete(*(runner_key(r, "inbox") for r in self.runners))

    def remove(self) -> None:
        for job_id in self.jobs:
            self.store.jobs.fail(job_id, "the test is over")
        self.clear_inboxes()
        self.store.redis.delete(*(runner_key(r, "jobs") for r in self.runners))
        self.store.redis.delete(*broker.queue_lists(self.queue))
        self.store.hosts.remove(self.name)


@pytest.fixture
def host(store: Store) -> Iterator[Host]:
    host = Host(store)
    yield host
    host.remove()


class WatchedBroker(Broker):
    """The real broker, which notes the job's record as each restore of messages begins."""

    def __init__(self, store: Store, celery: ExoCelery, job_id: str) -> None:
        super().__init__(store.redis, celery.connection_for_write)
        self.store, self.job_id = store, job_id
        self.job_at_restore: list[JobRecord | None] = []

    def restore(self, tags: Iterable[str]) -> None:
        self.job_at_restore.append(self.store.jobs.get(self.job_id))
        super().restore(tags)


def recovery(
    host: Host, celery: ExoCelery, incarnation: str, watched: Broker | None = None
) -> Recovery:
    return Recovery(
        host.store,
        watched or Broker(host.store.redis, celery.connection_for_write),
        lambda job: None,
        lambda job_id: False,
        host=host.name,
        incarnation=incarnation,
        stuck_after_s=60,
    )


def test_a_sweep_asks_each_runner_once_about_all_its_running_jobs(
    host: Host, celery: ExoCelery
) -> None:
    # One command per job, at every sweep (2 s), was ~1,000 inbox reads a second on a runner
    # with 2,000 streams.
    owner = host.incarnation(1)
    host.store.hosts.publish(host.state(owner, []), HEARTBEAT_TTL_S)  # alive: asked, not judged
    counts = {f"tiny@{host.name}": 3, f"other@{host.name}": 2}
    held = {r: [host.running(r, owner) for _ in range(n)] for r, n in counts.items()}
    host.clear_inboxes()  # the hand-overs' own commands

    recovery(host, celery, f"sweeper-{host.name}:1:1").sweep()

    for runner_id, jobs in held.items():
        inbox = host.inbox(runner_id)
        assert len(inbox) == 1, f"{runner_id}: {len(inbox)} commands"
        command = commands.validate_json(inbox[0])
        assert isinstance(command, CheckJobs)
        asked = sorted(command.jobs, key=lambda check: check.job_id)
        expected = [JobCheck(job_id=job.id, owner=owner, attempt=0) for job in jobs]
        assert asked == sorted(expected, key=lambda check: check.job_id)


def test_a_restarted_worker_requeues_its_old_jobs_before_it_restores_their_messages(
    host: Host, celery: ExoCelery
) -> None:
    # Restored first, a message taken at once by any worker finds its job running under an
    # incarnation that is gone: that worker requeues it itself, without the `requeued` log line
    # of the restart.
    previous = host.incarnation(1)
    job = host.running(f"tiny@{host.name}", previous)
    tag = uuid.uuid4().hex  # its message, delivered to the previous incarnation, as kombu has it
    message = {
        "body": "",
        "headers": {"id": job.id},
        "properties": {"delivery_tag": tag, "priority": 5, "delivery_info": {}},
    }
    host.store.redis.hset(broker.UNACKED, tag, json.dumps([message, "", host.queue]))
    host.store.redis.zadd(broker.UNACKED_INDEX, {tag: time.time() - 2})
    watched = WatchedBroker(host.store, celery, job.id)

    recovery(host, celery, host.incarnation(2), watched).recover_own_host(
        host.state(previous, [tag])
    )

    # The message went back once, to a job already queued for its next attempt.
    [at_restore] = watched.job_at_restore
    assert at_restore is not None
    assert (at_restore.status, at_restore.attempts) == (JobStatus.QUEUED, 1)
    events = [event.event for _, event in host.store.streams.read_events(job.id)]
    assert events.count("requeued") == 1
    assert job.id in broker.read_messages(host.store.redis, [host.queue]).queued_task_ids
    assert host.store.redis.hget(broker.UNACKED, tag) is None
