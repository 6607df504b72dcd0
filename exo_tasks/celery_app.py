"""The Celery application, bound to Settings; shared by the API (to send) and the worker."""

from __future__ import annotations

from functools import cached_property

from celery import Celery

from config.celery import celery_config
from config.settings import Settings
from exo_tasks.store import Store

INFERENCE_TASK = "exo.inference"
SHUTDOWN_RUNNER_TASK = "exo.shutdown_runner"
LOAD_RUNNER_TASK = "exo.load_runner"


class ExoCelery(Celery):
    """A Celery app that knows the project's settings and its Redis store."""

    def __init__(self, settings: Settings) -> None:
        super().__init__("exo_tasks", include=["exo_tasks.tasks"])
        self.settings = settings
        # This worker's incarnation (set by the worker before its pool forks): the owner that
        # the jobs it runs record. Empty outside a worker.
        self.incarnation = ""
        self.config_from_object(celery_config(settings))

    @cached_property
    def store(self) -> Store:
        return Store.from_url(self.settings.effective_redis_url, job_ttl_s=self.settings.job_ttl_s)
