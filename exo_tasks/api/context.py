"""What every request handler needs: settings, the Redis store and the Celery app."""

from __future__ import annotations

from dataclasses import dataclass

from flask import current_app

from config.settings import Settings
from exo_tasks.celery_app import ExoCelery
from exo_tasks.store import Store


@dataclass
class ApiContext:
    settings: Settings
    celery: ExoCelery

    @property
    def store(self) -> Store:
        return self.celery.store


def ctx() -> ApiContext:
    context: ApiContext = current_app.extensions["exo"]
    return context
