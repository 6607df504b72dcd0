"""The API's sending of direct jobs' tasks once due (exo_tasks.api.direct_tasks): each one the
delay after it was added, in order, on the executor given; one that fails is logged."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from exo_tasks.api.direct_tasks import DirectTaskSender

DELAY_S = 0.1


def test_each_task_is_sent_its_delay_after_it_was_added_in_order() -> None:
    sent: list[tuple[str, int, float]] = []
    done = threading.Event()

    def send(job_id: str, step: int) -> None:
        sent.append((job_id, step, time.monotonic()))
        if len(sent) == 3:
            done.set()

    with ThreadPoolExecutor(1) as executor:
        tasks = DirectTaskSender(DELAY_S, send, executor)
        added = {}
        for index, job_id in enumerate(("a", "b", "c")):
            added[job_id] = time.monotonic()
            tasks.add(job_id, index)
            time.sleep(0.03)
        assert done.wait(5)
    assert [(job_id, step) for job_id, step, _ in sent] == [("a", 0), ("b", 1), ("c", 2)]
    for job_id, _, at in sent:
        # Never before its delay; after it, as soon as a loaded machine wakes the thread.
        assert DELAY_S <= at - added[job_id] < DELAY_S + 2


def test_a_task_that_fails_to_send_is_logged_and_the_next_still_goes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sent: list[str] = []

    def send(job_id: str, step: int) -> None:
        if job_id == "down":
            raise ConnectionError("Redis unreachable")
        sent.append(job_id)

    with ThreadPoolExecutor(1) as executor, caplog.at_level(logging.WARNING):
        tasks = DirectTaskSender(0.01, send, executor)
        tasks.add("down", 0)
        tasks.add("up", 0)
        deadline = time.monotonic() + 5
        while not sent and time.monotonic() < deadline:
            time.sleep(0.01)
    assert sent == ["up"]
    [record] = [r for r in caplog.records if r.getMessage() == "direct job's task not sent"]
    assert record.__dict__["job_id"] == "down" and "unreachable" in record.__dict__["error"]
