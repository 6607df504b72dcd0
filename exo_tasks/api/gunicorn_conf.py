"""gunicorn's settings for `exo-tasks api` (`gunicorn -c python:exo_tasks.api.gunicorn_conf`),
from the project's Settings."""

from config.settings import Settings

_settings = Settings()

bind = f"{_settings.api_host}:{_settings.api_port}"
workers = _settings.api_workers
# gthread, giving threads only to requests that have arrived (see gunicorn_worker.py).
worker_class = "exo_tasks.api.gunicorn_worker.SlowClientSafeWorker"
threads = 32
graceful_timeout = 5
# How long a connection may stay silent, between requests or in the middle of one.
keepalive = 5
