"""The API's part of a direct hand-over (exo_tasks.direct): each job this process hands over has
its task sent, or its success announced, once due (jobs.send_direct_task). One thread waits for
them in turn: they come due in the order they were handed over, the same delay after. A process
that stops or dies first leaves the rest to the recovery loop (Store.direct_tasks)."""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future

log = logging.getLogger("exo_tasks.api")


class DirectTaskSender:
    """`send(job_id, step)` run on `executor`, `delay_s` after each add()."""

    def __init__(
        self, delay_s: float, send: Callable[[str, int], object], executor: Executor
    ) -> None:
        self.delay_s = delay_s
        self._send = send
        self._executor = executor
        self._due: queue.Queue[tuple[float, str, int]] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = False

    def add(self, job_id: str, step: int) -> None:
        self._due.put((time.monotonic() + self.delay_s, job_id, step))
        with self._lock:  # started on first use: in the process that serves, after its fork
            if not self._waiting:
                self._waiting = True
                threading.Thread(target=self._wait, name="exo-direct-tasks", daemon=True).start()

    def _wait(self) -> None:
        while True:
            due, job_id, step = self._due.get()
            time.sleep(max(0.0, due - time.monotonic()))
            sent = self._executor.submit(self._send, job_id, step)
            sent.add_done_callback(functools.partial(_log_failure, job_id))


def _log_failure(job_id: str, sent: Future[object]) -> None:
    """Say why a task was not sent (Redis unreachable, say): the recovery loop sends it."""
    if (error := sent.exception()) is not None:
        log.warning("direct job's task not sent", extra={"job_id": job_id, "error": str(error)})
