"""How a worker's stop begins: once per kind (warm, then perhaps cold), and a cold stop's first
move is ours, whatever Celery's pool waits for.

Celery's cold handler (SIGQUIT, or a second Ctrl-C during a warm stop) first stops the pool,
waiting for every task a child holds, and only then sends `worker_shutting_down`, where the
runners are told to put their jobs back. A task a child took after the warm stop began (a
direct job's: its runner started it before its message was delivered) is not one Celery
cancels, so its job ran to its last token under a cold stop, and the stop waited for it. So
the handler Celery installs for a cold signal is wrapped: ours runs first (`run_first`).

And a pool child that ends a task while the worker's main process no longer reads its results
(that same late task) waits for them to be read: billiard gives it 30 s. Each child here waits
RESULT_READ_WAIT_S (`bound_result_wait`); what it returned is then lost, and the task's message,
never acknowledged, goes back to its queue, where its job's record decides what it does.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import billiard.pool
from celery.signals import worker_ready, worker_shutting_down

# How long a pool child leaving the pool waits for the main process to read its last results.
RESULT_READ_WAIT_S = 1.0


class StopBegins:
    """Called as the worker's stop begins (Celery's `worker_shutting_down`, or first, from a
    cold signal): the worker is `stopping`, the runners `drain` (warm: `window_s` for their jobs
    to finish; cold: none, they put them back now), and the worker `leave`s (in a thread: it
    writes to Redis, and this runs in a signal handler)."""

    def __init__(
        self,
        stopping: threading.Event,
        drain: Callable[[float], None],
        window_s: float,
        leave: Callable[[bool], None],
    ) -> None:
        self.stopping, self.drain, self.window_s, self.leave = stopping, drain, window_s, leave
        self._begun: set[str] = set()

    def connect(self) -> None:
        worker_shutting_down.connect(self, weak=False)
        worker_ready.connect(lambda **_: run_first(signal.SIGQUIT, self.cold), weak=False)

    def __call__(self, how: str = "Warm", sig: str = "", **_: Any) -> None:
        if how == "Warm" and sig == "SIGINT":  # Celery has just made the next Ctrl-C cold
            run_first(signal.SIGINT, self.cold)
        if how in self._begun:
            return
        self._begun.add(how)
        self.stopping.set()
        self.drain(self.window_s if how == "Warm" else 0.0)  # only records a deadline
        threading.Thread(target=self.leave, args=(how != "Warm",), daemon=True).start()

    def cold(self) -> None:
        self("Cold")


def run_first(sig: signal.Signals, first: Callable[[], None]) -> None:
    """Make the handler now installed for `sig` (Celery's) call `first` before itself. `first`
    runs inside a signal handler: it may only record what to do, or start a thread."""
    installed = signal.getsignal(sig)
    if not callable(installed) or getattr(installed, "runs_first", None) == first:
        return

    def handler(signum: int, frame: FrameType | None) -> Any:
        first()
        return installed(signum, frame)

    handler.runs_first = first  # type: ignore[attr-defined]  # so it is wrapped once
    signal.signal(sig, handler)


def bound_result_wait() -> None:
    """In a pool child: wait at most RESULT_READ_WAIT_S, not 30 s, for its results to be read
    as it leaves the pool."""
    interval = billiard.pool.GUARANTEE_MESSAGE_CONSUMPTION_RETRY_INTERVAL
    billiard.pool.GUARANTEE_MESSAGE_CONSUMPTION_RETRY_LIMIT = round(RESULT_READ_WAIT_S / interval)
