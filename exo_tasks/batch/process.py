"""The batch feeder's own process, started by each worker. Not a thread of the worker's main
process: that process forks the prefork pool's children, and a thread that talks to Redis ten
times a second (with its own pool of senders) could hold a lock at the moment of a fork, and
would compete with Celery's event loop for the GIL. A process of its own shares nothing with the
pool; it leaves when the worker dies, and the lease it held lapses.

On Linux it is forked from the worker's main process, as the pool's children are, before them:
it shares the worker's imports and objects (~12 MiB of its own; a spawned interpreter, which
imported them all again, held 50). It builds its own app and Redis clients, never the worker's.
Elsewhere it is spawned (macOS: a fork of a process that has used the system's frameworks is
not safe)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from config.settings import Settings
from exo_tasks.batch.feeder import BatchFeeder
from exo_tasks.celery_app import ExoCelery
from exo_tasks.logs import configure_logging

log = logging.getLogger("exo_tasks.batches")
_context = (
    multiprocessing.get_context("fork")
    if sys.platform == "linux"
    else multiprocessing.get_context("spawn")
)
STOP_WAIT_S = 3.0
# What `ps` and `top` show for it (Linux: 15 characters at most).
PROCESS_NAME = "exo-feeder"
# Signals whose handlers a forked feeder inherits from Celery's main process (warm and cold
# shutdown, restart, dump tracebacks): back to what a fresh interpreter has, until its own.
CELERY_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def start(settings: Settings, holder: str) -> Any:
    """Start the feeder for this worker incarnation (`holder` of the feeder's lease)."""
    process = _context.Process(
        target=main, args=(settings, holder), name="exo-batch-feeder", daemon=True
    )
    process.start()
    return process


def stop(process: Any) -> None:
    if process.is_alive():
        process.terminate()
        process.join(STOP_WAIT_S)
    if process.is_alive():
        process.kill()
        process.join(STOP_WAIT_S)


def main(settings: Settings, holder: str) -> None:
    """Entry point of the feeder process."""
    # Our own process group, as the runners: a signal to the worker's group must not stop it
    # before the worker; it stops with the worker (SIGTERM from stop(), or its parent's death).
    os.setpgid(0, 0)
    for signum in CELERY_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    with contextlib.suppress(OSError):  # no /proc: not Linux
        Path("/proc/self/comm").write_text(PROCESS_NAME)
    # Celery's main process writes its stdout and stderr into its own logger, which would drop
    # what ours writes there (a logger writing into a logger): back to the process's own.
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    configure_logging(settings.log_level, host=settings.hostname, process="batch-feeder")
    feeder = BatchFeeder(ExoCelery(settings, role="batch-feeder"), holder)
    signal.signal(signal.SIGTERM, lambda *_: feeder.stop())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:

        def watch() -> None:
            multiprocessing.connection.wait([parent.sentinel])
            log.warning("worker process %s is gone; batch feeder exits", parent.pid)
            feeder.stop()

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    feeder.run()
