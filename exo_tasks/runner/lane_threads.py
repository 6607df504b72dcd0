"""Threads that run an engine's lanes, how many lanes a host runs and which lane a new job
joins: each lane's calls run one at a time on a thread of its own, for as long as the process
lives (lane 0 runs on the caller's thread)."""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections.abc import Callable, Sequence, Sized
from concurrent.futures import Future
from typing import Any, TypeVar

import mlx.core as mx

T = TypeVar("T")
MAX_AUTO_LANES = 8


# Small batches side by side are slower than one batch on the CPU (bench model, 2 cores: two
# lanes of 1 job make 17% fewer tokens/s than one lane of 2; two of 4, 7% more than one of 8;
# two of 16, 61% more than one of 32), so a lane is opened only once the busy ones hold this.
LANE_MIN_JOBS = 4
L = TypeVar("L", bound=Sized)


def lane_for_new_job(lanes: Sequence[L]) -> L:
    """The lane with the fewest jobs, of the busy ones until each holds LANE_MIN_JOBS."""
    busy = [lane for lane in lanes if len(lane)]
    if not busy or min(len(lane) for lane in busy) >= LANE_MIN_JOBS:
        busy = list(lanes)
    return min(busy, key=len)


def default_lanes() -> int:
    """One lane on a GPU; on the CPU one per core this process may use (up to MAX_AUTO_LANES)."""
    if mx.default_device() == mx.gpu:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, MAX_AUTO_LANES))


class LaneThread:
    """A thread that runs the calls given to it one at a time, for as long as the process lives.

    MLX gives each thread its own generation stream (mlx-lm's stream is thread-local). A thread
    that used one must not end: a process that exits while such a thread is being torn down
    aborts (std::terminate, seen in about half of the exits). So lane threads are daemons,
    made once and shared by the engines of a process (a runner has one engine).
    """

    _made: list[LaneThread] = []
    _made_lock = threading.Lock()

    @classmethod
    def number(cls, index: int) -> LaneThread:
        with cls._made_lock:
            while len(cls._made) <= index:
                cls._made.append(cls(f"engine-lane-{len(cls._made) + 1}"))  # lane 0: the caller
            return cls._made[index]

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        self._calls.put((future, functools.partial(fn, *args, **kwargs)))
        return future

    def _serve(self) -> None:
        while True:
            future, call = self._calls.get()
            settle(future, call)


def run_here(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
    """Lane 0's `submit`: it runs on the engine's caller's thread, at once."""
    future: Future[T] = Future()
    settle(future, functools.partial(fn, *args, **kwargs))
    return future


def settle(future: Future[T], call: Callable[[], T]) -> None:
    try:
        future.set_result(call())
    except Exception as exc:  # noqa: BLE001 (the caller gets it from the future)
        future.set_exception(exc)
