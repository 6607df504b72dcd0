"""gunicorn's settings for `exo-tasks api` (`gunicorn -c python:exo_tasks.api.gunicorn_conf`),
from the project's Settings."""

import importlib
import os
import signal
import sys
from typing import Any

from gunicorn.errors import HaltServer

from config.settings import Settings
from exo_tasks.api.arrivals import Board, Seating
from exo_tasks.forks import freeze_at_fork
from exo_tasks.process_exit import exit_now

# The workers are forked from this master: what it imported stays shared with them.
freeze_at_fork()
# And what gevent's monkey patching imports in each worker (~2.5 MiB of each), imported here:
# gevent's own modules, made to be imported before anything is patched.
GEVENT_PATCH_MODULES = (
    "gevent.events",
    "gevent.lock",
    "gevent.pool",
    "gevent.queue",
    "gevent.select",
    "gevent.selectors",
    "gevent.signal",
    "gevent.ssl",
    "gevent.subprocess",
    "gevent.thread",
    "gevent.threading",
    "gevent.threadpool",
    "gevent.time",
    "gevent.util",
    "zope.event",
)
for _module in GEVENT_PATCH_MODULES:
    importlib.import_module(_module)


def _hold_sigterm() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def _release_sigterm() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _worker_takes_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _release_sigterm()


# A worker just forked has the master's signal handlers until gunicorn installs its own (after
# gevent's patching), and they queue a signal for a master that is not in this process: a
# SIGTERM then was lost, and the worker booted on and held the API's stop until
# graceful_timeout (5 s, past the stack's 2 s). Until then SIGTERM ends it at once: it holds
# nothing yet. The signal is held across the fork itself, so that one sent to the new worker
# before its handler is reset waits for that, not for the master's handler.
os.register_at_fork(
    before=_hold_sigterm, after_in_parent=_release_sigterm, after_in_child=_worker_takes_sigterm
)
_settings = Settings()
# The doors of this host's API processes (see arrivals.py), made here, in the master, so that
# every worker it forks shares it: a seat for each worker and for its replacement, which a
# reload starts before the old one leaves. Every streamed request reads every seat.
_seating = Seating(Board(seats=2 * _settings.api_workers))

bind = f"{_settings.api_host}:{_settings.api_port}"
workers = _settings.api_workers
# gevent: a connection is a greenlet, so open streams cost no thread (see gunicorn_worker.py).
worker_class = "exo_tasks.api.gunicorn_worker.StreamingWorker"
# Connections per worker: its EXO_MAX_STREAMS streams, and as many others again (health checks,
# submissions, slow clients) so that a full house of streams never keeps them out.
worker_connections = 2 * _settings.max_streams + 1024
graceful_timeout = 5
# How long a connection may stay silent, between requests or in the middle of one.
keepalive = 5


def pre_fork(server: Any, worker: Any) -> None:
    worker.arrivals_board = _seating.board
    worker.arrivals_seat = _seating.seat()


def child_exit(server: Any, worker: Any) -> None:
    _seating.free(worker.arrivals_seat)


def on_exit(server: Any) -> None:
    """The master has reaped its workers: it leaves without the interpreter's teardown (0.4 s
    of a loaded machine, inside the stack's 2 s for the API to stop). gunicorn calls this from
    its handler of why it halts: a HaltServer (a worker that could not boot) keeps its status."""
    reason = sys.exc_info()[1]
    exit_now(reason.exit_status if isinstance(reason, HaltServer) else 0)
