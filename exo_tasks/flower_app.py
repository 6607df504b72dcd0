"""The Celery app as Flower loads it (`celery -A exo_tasks.flower_app flower`), with Flower's
`/metrics` behind Flower's own auth, its API's 401 asking for basic auth, and its pages showing
what is current (exo_tasks.flower_pages).

Flower 2.2.0 checks basic auth only in handlers marked `@authenticated`; its Prometheus
`/metrics` is not, so it answers anyone who can connect, whatever `--basic-auth` says.

Flower's pages answer 401 with `WWW-Authenticate: Basic realm="flower"`, its API (`/api/...`)
without it: a browser that opened a deep link (`/task/<id>`) holds credentials for that page's
path only, and re-sends them to `/api/task/revoke/...` only when the 401 names the same realm.
Without it the Terminate button got an empty red notice and did nothing.

Flower's Broker tab (queue lengths) asks the master of only the Sentinel that its broker URL
names first (flower.utils.broker.RedisSentinel, whose comment says all were meant): with that
Sentinel gone the tab failed, while kombu (workers, tasks, events) tried the others. It asks
them all in turn here, as kombu and our own clients do.

Flower inspects the workers as it starts, usually before any is up (`exo-tasks up` starts them
together): a warning for each of four inspect methods that no worker answered in time. It
shows the workers from their events all the same, and inspects again whenever a worker's page
is opened or the list refreshed, so that warning is dropped; an inspection that raised is
still logged.
"""

from __future__ import annotations

import logging
from typing import Any

import tornado.web
from flower.api import BaseApiHandler
from flower.utils.broker import RedisSentinel
from flower.views.monitor import Metrics
from redis.asyncio.sentinel import Sentinel

from config.settings import Settings
from exo_tasks import flower_pages
from exo_tasks.broker import close_every_channel
from exo_tasks.celery_app import ExoCelery

# Flower's own app, not the worker's (exo_tasks.worker.app): it sends control commands and
# reads events, and needs none of the worker's supervisor, runners and feeder (~8 MiB).
close_every_channel()  # as the worker's: a Redis restart must not end Flower's connection
app = ExoCelery(Settings(), role="flower")
__all__ = ["app"]

# The realm of Flower's own pages (flower.views.BaseHandler.write_error).
BASIC_CHALLENGE = 'Basic realm="flower"'


def _authenticated(handler: Any) -> None:
    # `current_user` runs Flower's own check: HTTPError(401) for wrong basic-auth credentials,
    # None without an OAuth login, True when no auth is configured at all.
    if not handler.current_user:
        raise tornado.web.HTTPError(401)


_api_write_error = BaseApiHandler.write_error


def _api_error_with_challenge(handler: Any, status_code: int, **kwargs: Any) -> None:
    if status_code == 401 and handler.application.options.basic_auth:
        handler.set_header("WWW-Authenticate", BASIC_CHALLENGE)
    _api_write_error(handler, status_code, **kwargs)


_flower_sentinel_client = RedisSentinel._get_redis_client


def _through_every_sentinel(broker: Any, broker_options: Any, broker_use_ssl: Any) -> Any:
    """The client Flower builds (its options, the master's name), through every Sentinel."""
    client = _flower_sentinel_client(broker, broker_options, broker_use_ssl)
    sentinels = app.settings.sentinels
    if sentinels is None:
        return client
    manager = client.connection_pool.sentinel_manager
    every = Sentinel(  # type: ignore[no-untyped-call]
        sentinels.addresses, sentinel_kwargs=manager.sentinel_kwargs, **manager.connection_kwargs
    )
    return every.master_for(broker.master_name)


def _unless_unanswered(record: logging.LogRecord) -> bool:
    # flower.inspector's own words when `inspect` returned no reply at all (None).
    return record.msg != "Inspect method %s failed"


Metrics.prepare = _authenticated
BaseApiHandler.write_error = _api_error_with_challenge
RedisSentinel._get_redis_client = _through_every_sentinel
logging.getLogger("flower.inspector").addFilter(_unless_unanswered)
flower_pages.install()
