"""The Celery application, bound to Settings; shared by the API (to send) and the worker."""

from __future__ import annotations

import os
from functools import cached_property
from typing import Any, cast

from celery import Celery, Task
from celery.app.amqp import AMQP

from config.celery import celery_config
from config.settings import Settings
from exo_tasks.broker import reuse_clients
from exo_tasks.store import Store

INFERENCE_TASK = "exo.inference"
SHUTDOWN_RUNNER_TASK = "exo.shutdown_runner"
LOAD_RUNNER_TASK = "exo.load_runner"


def exo_app(task: Task[Any, Any]) -> ExoCelery:
    """The app a task of ours runs in (Celery types it as its own base class)."""
    return cast(ExoCelery, task.app)


class NamedSenderAMQP(AMQP):
    """Celery's messaging, with the `task-sent` events naming the process that sent the task
    (Flower's "Client" on a task's page) by what it is: `exo-api@vm (pid 6264)`, not Celery's
    anonymous `gen6264@vm`. Built on first use, so in the process that sends (after a fork)."""

    @cached_property
    def _event_dispatcher(self) -> Any:
        app = cast(ExoCelery, self.app)
        sender = f"exo-{app.role}@{app.settings.hostname} (pid {os.getpid()})"
        # As Celery's own: published through the sending producer, so never enabled itself.
        return app.events.Dispatcher(hostname=sender, enabled=False)


class ExoCelery(Celery):
    """A Celery app that knows the project's settings and its Redis store. `role`: what the
    process is (api, worker, batch-feeder), as the tasks it sends name it."""

    amqp_cls = f"{__name__}:NamedSenderAMQP"

    def __init__(self, settings: Settings, role: str = "client") -> None:
        super().__init__(
            "exo_tasks", include=["exo_tasks.worker.tasks", "exo_tasks.worker.runner_tasks"]
        )
        reuse_clients()  # not a new redis-py client per message sent (exo_tasks/broker.py)
        self.settings = settings
        self.role = role
        # This worker's incarnation (set by the worker before its pool forks): the owner that
        # the jobs it runs record. Empty outside a worker.
        self.incarnation = ""
        self.config_from_object(celery_config(settings))
        self.store = self._new_store()
        # The store the pool's children take as their own (prepare_forks), if made.
        self._children_store: Store | None = None

    def _new_store(self) -> Store:
        # No connection yet: the pool connects on first use.
        return Store.from_url(self.settings.effective_redis_url, job_ttl_s=self.settings.job_ttl_s)

    def _get_backend(self) -> Any:
        """Celery's result backend, less its subscription at each send: Redis's subscribes to
        a task's result channel as the task is sent, for a `.get()` on the result `send_task`
        returns. Nothing here waits on a task it sends, and a `.get()` still works (it
        subscribes, then reads the stored state); each job paid a SUBSCRIBE and, as its
        result was dropped, an UNSUBSCRIBE."""
        backend = super()._get_backend()  # type: ignore[misc]  # (not in celery-types)
        backend.on_task_call = _no_subscription
        return backend

    def send_sent_event(self, producer: Any, **fields: Any) -> None:
        """The `task-sent` event of a task announced, not sent (exo_tasks.task_results), from
        this process as its sent tasks' name it."""
        cast(NamedSenderAMQP, self.amqp)._event_dispatcher.publish("task-sent", fields, producer)

    def prepare_forks(self) -> None:
        """Before this process forks the children that each take a store of their own
        (`renew_store`): one store made here and never used here, for every child to take.
        Made in each child instead, it cost each child ~1 MiB of its own: its construction ran
        and wrote to the parent's pages, which a child then copies."""
        self._children_store = self._new_store()

    def renew_store(self) -> None:
        """A store with a Redis pool of its own. A forked pool child needs one: a thread of
        the parent (heartbeat, recovery, supervisor) may have held the pool's lock at the fork,
        and the child inherits the lock but not the thread that would release it, so its first
        Redis call would wait for ever. The store `prepare_forks` made has no such lock held:
        no thread of the parent ever used it (its pool connects afresh in each child)."""
        self.store = self._children_store or self._new_store()


def _no_subscription(producer: Any, task_id: str) -> None:
    """A result backend's `on_task_call` that does nothing (ExoCelery._get_backend)."""
