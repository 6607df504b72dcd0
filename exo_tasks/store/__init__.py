"""Redis: the one facade every process uses, composed of one part per concern, each over the
one client they share.

- `keys`: the key layout; `client`: the connection and the refusals a writer waits out.
- `store.jobs`: job records; executes exo_tasks.lifecycle's moves (each ending counted in
  `store.metrics`), which append to the job's streams.
- `store.streams`: each job's event and endings streams, read (the API's streams, a job's
  progress, the task that waits for a job's ending).
- `store.runners`: runner state and history, inboxes, and the hand-over of a job to a runner
  (the jobs of a runner that is gone ended or requeued through `store.jobs`).
- `store.hosts`: heartbeats (worker incarnations), leases, supervisor inboxes, the
  prefix-to-host map.
- `store.metrics`: metric persistence, and Redis's memory.
- `store.instances`: model instances across hosts, their ranks' records and ring addresses.
- `store.files`, `store.batches`: OpenAI's Files and Batch API (exo_tasks.batch.feeder drives
  batches).
kombu's own layout (queues, unacknowledged messages) is exo_tasks.broker's alone.
"""

from __future__ import annotations

from typing import Any

import redis

from exo_tasks.store.batches import BatchRecords
from exo_tasks.store.client import ScriptCall, connect, redis_waits
from exo_tasks.store.direct_tasks import DirectTasks
from exo_tasks.store.files import FileRecords
from exo_tasks.store.hosts import HostRecords
from exo_tasks.store.instances import InstanceRecords
from exo_tasks.store.jobs import Admission, JobRecords, JobWhereabouts
from exo_tasks.store.keys import (
    PREFIX,
    endings_key,
    events_key,
    host_key,
    hub_wake_key,
    job_key,
    runner_key,
)
from exo_tasks.store.metrics import MetricRecords
from exo_tasks.store.runners import RunnerRecords, UnreadableCommand
from exo_tasks.store.streams import JobStreams

__all__ = [
    "PREFIX",
    "JobWhereabouts",
    "Store",
    "UnreadableCommand",
    "connect",
    "endings_key",
    "events_key",
    "host_key",
    "hub_wake_key",
    "job_key",
    "redis_waits",
    "runner_key",
]


class Store:
    """Typed access to everything exo_tasks keeps in Redis, one part per concern."""

    def __init__(self, client: redis.Redis, *, job_ttl_s: int = 24 * 3600) -> None:
        # Any: as each part's (exo_tasks.store.client.RedisPart).
        self.redis: Any = client
        self.metrics = MetricRecords(client)
        self.streams = JobStreams(client)
        self.jobs = JobRecords(client, self.streams, job_ttl_s=job_ttl_s)
        self.runners = RunnerRecords(client, self.jobs)
        self.hosts = HostRecords(client)
        self.instances = InstanceRecords(client)
        self.files = FileRecords(client)
        self.batches = BatchRecords(client)
        self.direct_tasks = DirectTasks(client)

    @classmethod
    def from_url(cls, url: str, *, job_ttl_s: int = 24 * 3600) -> Store:
        return cls(connect(url), job_ttl_s=job_ttl_s)

    def ping(self) -> bool:
        return bool(self.redis.ping())

    def create(self, creation: ScriptCall, hand_over: ScriptCall | None) -> tuple[Admission, bool]:
        """A job's creation (JobRecords.creation), then its hand-over to a runner, if any
        (RunnerRecords.handing: none if the creation was refused), in one round trip; whether
        it was handed over."""
        if hand_over is None:
            return Admission.of(self.jobs.run(creation)), False
        pipe = self.redis.pipeline(transaction=False)
        creation.queue_on(pipe)
        hand_over.queue_on(pipe)
        created, handed = pipe.execute()
        return Admission.of(created), bool(handed)

    def drop_connections(self) -> None:
        """Close every connection, after an exception raised from outside (a signal's) that
        may have landed between a command and its reply: the next command on that connection
        would read the unread reply as its own (seen: the runner's state read as a job)."""
        client: redis.Redis = self.redis
        client.connection_pool.disconnect()
