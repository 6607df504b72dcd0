"""One read for everybody who asks at once.

The API routes every job from the fleet's state and its queue's depth, read from Redis. When
thousands of clients arrive together, reading both for each of them is most of what an API
process does (measured: a fifth of its CPU at 2,000 streams). A SharedRead lets the callers
who ask while a read is under way wait for the next one, and share it: each caller still gets
a read that began after it asked, never an older one, so nothing is served from a cache.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class SharedRead(Generic[T]):
    """`read`, called once for every group of callers that asked during the previous call.
    Threads and greenlets alike (gevent patches the locks)."""

    def __init__(self, read: Callable[[], T]) -> None:
        self._read = read
        self._lock = threading.Lock()  # guards _next
        self._reading = threading.Lock()  # one read at a time
        self._next: Future[T] | None = None  # the read the callers who ask now will share

    def get(self) -> T:
        with self._lock:
            shared = self._next
            leads = shared is None
            if shared is None:
                shared = self._next = Future()
        if leads:
            self._lead(shared)
        return shared.result()

    def _lead(self, shared: Future[T]) -> None:
        """Wait for the read under way, then read for everybody who joined meanwhile."""
        with self._reading:
            with self._lock:
                self._next = None  # who asks from now on asked after this read began
            try:
                shared.set_result(self._read())
            except Exception as exc:  # noqa: BLE001 (each caller of the group raises it: Redis down, 503)
                shared.set_exception(exc)
            finally:
                if not shared.done():  # the leader was killed mid-read (its worker stopping)
                    shared.set_exception(RuntimeError("the shared read was interrupted"))
