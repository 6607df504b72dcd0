"""The entry point of a spawned runner process: its own process group, logs that name it, an
exit when the worker dies, signals, then the batching loop until it stops."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from typing import Any

from exo_tasks.logs import configure_logging
from exo_tasks.runner.loop import Runner
from exo_tasks.runner.process import RunnerProgress, RunnerSpec

log = logging.getLogger("exo_tasks.runner")


def main(spec_json: str, progress_array: Any) -> None:
    """Entry point of the spawned runner process."""
    spec = RunnerSpec.model_validate_json(spec_json)
    # Our own process group: a signal sent to the worker's group (honcho, a terminal's Ctrl-C)
    # must not reach the runner; the supervisor decides when it stops.
    os.setpgid(0, 0)
    configure_logging(spec.log_level, runner=spec.runner_id, host=spec.host)
    _exit_with_parent()
    runner = Runner(spec, RunnerProgress(progress_array))
    signal.signal(signal.SIGTERM, lambda *_: runner.on_sigterm())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(runner.run())


def _exit_with_parent() -> None:
    """Leave at once if the worker dies (SIGKILL included), so no model stays resident."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        log.error("worker process %s is gone; runner exits", parent.pid)
        os._exit(70)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
