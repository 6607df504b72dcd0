"""SharedRead: callers who ask together share one read, and never get one that began before
they asked."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from exo_tasks.shared_read import SharedRead


class SlowCounter:
    """A read that takes until `release` is set, and counts the reads that began."""

    def __init__(self) -> None:
        self.began = 0
        self.release = threading.Event()
        self.in_read = threading.Event()

    def read(self) -> int:
        self.began += 1
        number = self.began
        self.in_read.set()
        assert self.release.wait(5)
        return number


def ask_together(
    pool: ThreadPoolExecutor, shared: SharedRead[int], count: int
) -> list[Future[int]]:
    """`count` callers of `shared.get`, returned once all of them are inside it."""
    arrived = threading.Semaphore(0)

    def ask() -> int:
        arrived.release()
        return shared.get()

    futures = [pool.submit(ask) for _ in range(count)]
    for _ in range(count):
        assert arrived.acquire(timeout=5)
    time.sleep(0.2)  # from the semaphore into get(): a few instructions
    return futures


def test_callers_who_ask_during_a_read_share_the_next_one() -> None:
    counter = SlowCounter()
    shared = SharedRead(counter.read)
    with ThreadPoolExecutor(51) as pool:
        first = pool.submit(shared.get)
        assert counter.in_read.wait(5)
        # 50 callers arrive while read 1 is under way: none may get read 1's answer.
        later = ask_together(pool, shared, 50)
        counter.release.set()
        assert first.result(5) == 1
        assert {f.result(5) for f in later} == {2}
    assert counter.began == 2


def test_a_lone_caller_reads_at_once() -> None:
    calls = iter(range(10))
    shared = SharedRead(lambda: next(calls))
    assert [shared.get() for _ in range(3)] == [0, 1, 2]


def test_a_failed_read_fails_every_caller_of_its_group_and_the_next_read_is_new() -> None:
    counter = SlowCounter()
    failing = {"now": True}

    def read() -> int:
        number = counter.read()
        if failing["now"]:
            raise ConnectionError("redis down")
        return number

    shared = SharedRead(read)
    with ThreadPoolExecutor(11) as pool:
        first = pool.submit(shared.get)
        assert counter.in_read.wait(5)
        group = ask_together(pool, shared, 10)
        counter.release.set()
        for future in [first, *group]:
            with pytest.raises(ConnectionError):
                future.result(5)
    failing["now"] = False
    assert shared.get() == 3
