"""What every request handler needs: settings, the Redis store and the Celery app."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property

from flask import current_app

from config.settings import Settings
from exo_tasks import jobs
from exo_tasks.api.streams import EventHub, StreamCap
from exo_tasks.celery_app import ExoCelery
from exo_tasks.fleet import SharedReads
from exo_tasks.store import Store, connect
from exo_tasks.types import JobRecord, JobRequest

# Submissions (a record, then a Celery message) that one API process runs at the same moment.
SENDERS = 8


@dataclass
class ApiContext:
    settings: Settings
    celery: ExoCelery

    @cached_property
    def store(self) -> Store:
        """Redis for requests, on at most EXO_API_REDIS_CONNECTIONS connections: under the
        gevent worker thousands of requests run at once, and they wait for a connection
        instead of opening one each."""
        client = connect(
            self.settings.effective_redis_url, max_connections=self.settings.api_redis_connections
        )
        return Store(client, job_ttl_s=self.settings.job_ttl_s)

    @cached_property
    def _senders(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(SENDERS, thread_name_prefix="exo-submit")

    @cached_property
    def reads(self) -> SharedReads:
        """The fleet and queue depths, each read shared by the requests that ask together."""
        return SharedReads(self.store)

    def submit(
        self, job_request: JobRequest, job_id: str | None = None, where: jobs.Route | None = None
    ) -> JobRecord:
        """jobs.submit, routed by the shared reads, on one of SENDERS long-lived threads
        (greenlets under gevent). Celery keeps a result backend, with a Redis connection of its
        own, per thread: submitted from each request's own greenlet, every job cost a
        connection that stayed open."""
        where = where or jobs.route(self.reads.fleet(), self.settings, job_request)
        return self._senders.submit(
            jobs.submit, self.store, self.celery, self.settings, job_request, job_id, where
        ).result()

    @cached_property
    def hub(self) -> EventHub:
        """The process's one reader of job streams (its own connection)."""
        url = self.settings.effective_redis_url
        return EventHub(lambda: connect(url), self.settings.stream_buffer_events)

    @cached_property
    def streams(self) -> StreamCap:
        return StreamCap(self.settings.max_streams)


def ctx() -> ApiContext:
    context: ApiContext = current_app.extensions["exo"]
    return context
