"""What every request handler needs: settings, the Redis store and the Celery app."""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from flask import Response, after_this_request, current_app, has_request_context

from config.settings import Settings
from exo_tasks import jobs, replication
from exo_tasks.api.arrivals import MAX_WAIT_S, Arrivals, Passage
from exo_tasks.api.direct_tasks import DirectTaskSender
from exo_tasks.api.prompt_door import PromptDoor
from exo_tasks.api.streams import EventHub, StreamCap
from exo_tasks.celery_app import ExoCelery
from exo_tasks.errors import StorageFull
from exo_tasks.fairness import Client
from exo_tasks.fleet import SharedReads
from exo_tasks.store import Store, connect
from exo_tasks.types import JobRecord, JobRequest

log = logging.getLogger("exo_tasks.api")
# Submissions (a record, then a Celery message) that one API process runs at the same moment.
SENDERS = 8


class ApiContext:
    """Built whole when the process's app is created, before it serves: nothing here is built
    on a first request. A `functools.cached_property` guards its first call with an RLock that
    predates gevent's patching, which every greenlet of the process passes; building a Redis
    pool yields, so a cold process hit by a burst built a store (and a pool) per request:
    1,469 Redis connections and first bytes 10-15 s late at 2,000 streams."""

    def __init__(self, settings: Settings, celery: ExoCelery) -> None:
        self.settings = settings
        self.celery = celery
        # Requests use at most EXO_API_REDIS_CONNECTIONS connections: under the gevent
        # worker thousands run at once, and they wait for a connection instead of opening one.
        self.store = Store(
            connect(settings.effective_redis_url, max_connections=settings.api_redis_connections),
            job_ttl_s=settings.job_ttl_s,
        )
        # The fleet and queue depths, each read shared by the requests that ask together.
        self.reads = SharedReads(self.store)
        # The process's one reader of job streams, on its own connection.
        url = settings.effective_redis_url
        self.hub = EventHub(lambda: connect(url), settings.stream_buffer_events, self.store.redis)
        self.streams = StreamCap(settings.max_streams)
        self.arrivals = Arrivals()
        self.prompt_door = PromptDoor(settings)
        # Behind Sentinels what is accepted waits, bounded, for a replica (replication.py).
        self.replica_wait_ms = replication.wait_ms(settings)
        self._past_the_door = threading.BoundedSemaphore(SENDERS)
        self._senders = ThreadPoolExecutor(SENDERS, thread_name_prefix="exo-submit")
        self.direct_task_sender = DirectTaskSender(
            settings.direct_task_delay_ms / 1000,
            functools.partial(jobs.send_direct_task, self.store, celery, settings),
            self._senders,
        )

    def refuse_if_storage_low(self, memory: tuple[int, int] | None = None) -> None:
        """503 (storage_full) for a client's new job, file or batch once Redis holds its
        maxmemory less the fleet's reserve: the fleet's own writes (heartbeats, running jobs'
        tokens, endings, cancels) keep that room, while Redis refuses every write past
        maxmemory, whoever writes. A quarter of maxmemory at most is reserved. `memory`: Redis's
        memory in use and its maxmemory as just read (a Door), else read here."""
        used, limit = memory or self.reads.memory()
        reserve = min(self.settings.redis_reserve_mb << 20, limit // 4)
        if limit and used >= limit - reserve:
            raise StorageFull(
                f"the job store (Redis) holds {used >> 20} MiB of its {limit >> 20} MiB, the "
                f"rest kept for running jobs and the fleet (EXO_REDIS_RESERVE_MB); retry once "
                "older jobs expire (EXO_JOB_TTL_S) or raise EXO_REDIS_MAXMEMORY_MB"
            )

    def admit(self, job_request: JobRequest) -> jobs.Route:
        """Where a new job goes, once past the door: its prompt and sampling checked against
        its model's tokenizer (422), room in the store (503), then its route (jobs.route)."""
        self.prompt_door.check(job_request)
        door = self.reads.door()
        self.refuse_if_storage_low(door.memory)
        return jobs.route(door.fleet, self.settings, job_request, self.store)

    def submit(
        self,
        job_request: JobRequest,
        job_id: str | None = None,
        where: jobs.Route | None = None,
        *,
        client: Client,
        arrival: Passage | None = None,
    ) -> JobRecord:
        """jobs.submit, routed by the shared reads, on one of SENDERS long-lived threads
        (greenlets under gevent). Celery keeps a result backend, with a Redis connection of its
        own, per thread: submitted from each request's own greenlet, every job cost a
        connection that stayed open.

        `arrival` (a stream's job, after its first byte: its request's way in): sent once the
        host's arrivals are in, or at once if its request came alone (arrivals.py). Such jobs
        pass the door SENDERS at a time, each looking again just before it is sent, so a burst
        that resumes holds back the ones not yet sent; and they never hold a sender while they
        wait, so other submissions do not. `client`: who sent it (auth.client), for its quota
        and its place in the queue."""
        where = where or jobs.route(self.reads.fleet(), self.settings, job_request, self.store)
        if arrival is None:
            return self._send(job_request, job_id, where, client)
        deadline = time.monotonic() + MAX_WAIT_S
        with self._past_the_door:
            self.arrivals.wait_until_quiet(deadline - time.monotonic(), arrival)
            return self._send(job_request, job_id, where, client)

    def _send(
        self, job_request: JobRequest, job_id: str | None, where: jobs.Route, client: Client
    ) -> JobRecord:
        send = functools.partial(
            jobs.submit,
            self.store,
            self.celery,
            self.settings,
            client=client,
            later=self.direct_task_sender.add,
        )
        job = self._senders.submit(send, job_request, job_id, where).result()
        self.replicate("a job", job_id=job.id)
        return job

    def replicate(self, what: str, **ids: str) -> None:
        """Return once a replica holds what this request wrote, or the wait's bound passed;
        if none holds it, the answer says so (a stream's headers may be sent already)."""
        settled = replication.settle(self.store.redis, self.replica_wait_ms, what, **ids)
        if not settled and has_request_context():
            after_this_request(_not_replicated)


def _not_replicated(response: Response) -> Response:
    response.headers["Exo-Replicated"] = "false"
    return response


def ctx() -> ApiContext:
    context: ApiContext = current_app.extensions["exo"]
    return context
