"""The batch feeder's own process, spawned by each worker. Not a thread of the worker's main
process: that process forks the prefork pool's children, and a thread that talks to Redis ten
times a second (with its own pool of senders) could hold a lock at the moment of a fork, and
would compete with Celery's event loop for the GIL. Spawned, it shares nothing with the pool;
it leaves when the worker dies, and the lease it held lapses."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from typing import Any

from config.settings import Settings
from exo_tasks.batch.feeder import BatchFeeder
from exo_tasks.celery_app import ExoCelery
from exo_tasks.logs import configure_logging

log = logging.getLogger("exo_tasks.batches")
_spawn = multiprocessing.get_context("spawn")
STOP_WAIT_S = 3.0


def start(settings: Settings, holder: str) -> Any:
    """Spawn the feeder for this worker incarnation (`holder` of the feeder's lease)."""
    process = _spawn.Process(
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
    """Entry point of the spawned feeder process."""
    # Our own process group, as the runners: a signal to the worker's group must not stop it
    # before the worker; it stops with the worker (SIGTERM from stop(), or its parent's death).
    os.setpgid(0, 0)
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
