"""Rank 0's SIGTERM when its main thread is blocked in a collective.

A Python signal handler runs only between bytecodes of the main thread, and rank 0's main
thread can be blocked in a collective that never returns (a peer that stopped answering, a ring
that lost one, a ring that never forms): its handler (`Runner.on_sigterm`, as a whole runner's)
would wait there until the supervisor's SIGKILL. So rank 0 also has the signal written to a
wakeup fd (by the C-level handler, whichever thread it lands on), and a thread reads it. If the
main thread is still inside a collective PATIENCE_S after SIGTERM, nothing will come back from
it: the thread ends the process with SIGTERM's exit code, 143, as the runner's own handler does
when it cannot stop in order, and the supervisor records `exitcode=143 (SIGTERM)`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator

from exo_tasks.runner.process import EXIT_TERMINATED

log = logging.getLogger("exo_tasks.runner")
# How long a collective may go on after SIGTERM before the rank counts as blocked in it. A
# healthy one (a step, a plan) takes milliseconds on the tiny model; a blocked one never ends.
PATIENCE_S = 1.0
POLL_S = 0.05


class Collectives:
    """Whether rank 0's main thread is inside a collective (joining the ring, loading its
    shard, a step and its plan), and since when."""

    def __init__(self) -> None:
        self.since: float | None = None

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        self.since = time.monotonic()
        try:
            yield
        finally:
            self.since = None

    def blocked(self, termed: float, now: float) -> bool:
        """Inside one for PATIENCE_S since it began or since SIGTERM (`termed`), if later."""
        since = self.since
        return since is not None and now - max(since, termed) > PATIENCE_S


def watch_sigterm(collectives: Collectives) -> None:
    """From the main thread, once the SIGTERM handler is installed."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(
        target=_watch, args=(read_fd, collectives), name="sigterm", daemon=True
    ).start()


def _watch(read_fd: int, collectives: Collectives) -> None:
    while int(signal.SIGTERM) not in os.read(read_fd, 64):
        pass
    termed = time.monotonic()
    while not collectives.blocked(termed, time.monotonic()):
        time.sleep(POLL_S)
    log.error("SIGTERM while blocked in a collective that does not return; the rank exits")
    os._exit(EXIT_TERMINATED)
