"""A runner's step writes on a thread of their own (exo_tasks.runner.step_writer): the loop
hands a step over without waiting for Redis; the steps reach Redis in order, those that waited
merged into one write; a refused write is kept in front of the later ones and tried again only
when the loop asks, which raises while Redis still refuses; a write that failed after it landed
is not written again."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from exo_tasks import metrics
from exo_tasks.runner.step_writer import Step, StepWriter
from exo_tasks.types import JobRecord, TokenEvent
from tests.unit.fakes import new_job

WAIT_S = 5.0


class SlowRedis:
    """`write_step` as the store has it, which waits while `gate` is closed; `down`: refused;
    `reply_lost`: the next write is applied, and then its connection drops."""

    def __init__(self) -> None:
        self.written: list[tuple[list[int], list[str], float]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.writing = threading.Event()
        self.down = False
        self.reply_lost = False
        self.mark = ""
        self.after: list[list[Any]] = []  # what each write carried after its steps

    def write_step(self, runner_id: str, *step: Any, after: Sequence[Any] = ()) -> None:
        tokens, observations, endings, _hints, mark = step
        self.after.append(list(after))
        self.writing.set()
        assert self.gate.wait(WAIT_S)
        if self.down:
            raise redis.ConnectionError("Connection refused (fake)")
        pipe = CountingPipe()
        observations.write(pipe)
        self.written.append(([t.index for _, t in tokens], [j.id for j in endings], pipe.total))
        self.mark = mark
        if self.reply_lost:
            self.reply_lost = False
            raise redis.ConnectionError("Connection closed by server (fake)")

    def step_written(self, runner_id: str, mark: str) -> bool:
        if self.down:
            raise redis.ConnectionError("Connection refused (fake)")
        return mark == self.mark


class CountingPipe:
    def __init__(self) -> None:
        self.total = 0.0

    def hincrbyfloat(self, key: str, field: str, amount: float) -> Any:
        self.total += amount


@dataclass(frozen=True)
class StateOf:
    """A write that goes after a step's (the runner's state, in the runner)."""

    name: str

    def queue_on(self, pipe: Any) -> None:
        pass


def step(*indices: int, ended: JobRecord | None = None, then: str | None = None) -> Step:
    observations = metrics.Observations()
    observations.inc(metrics.PREFIX_CACHE_HITS, len(indices), model="tiny")
    tokens = [("j1", TokenEvent(index=i, text="x")) for i in indices]
    return Step(
        tokens, observations, [ended] if ended else [], after=[StateOf(then)] if then else []
    )


@pytest.fixture
def slow() -> SlowRedis:
    return SlowRedis()


@pytest.fixture
def writer(slow: SlowRedis) -> StepWriter:
    return StepWriter(slow, "tiny@unit")


def written(slow: SlowRedis) -> list[list[int]]:
    """The token indices of each write, in order."""
    return [indices for indices, _, _ in slow.written]


def test_a_step_is_handed_over_without_waiting_for_redis(
    slow: SlowRedis, writer: StepWriter
) -> None:
    slow.gate.clear()  # Redis answers only once the gate opens
    writer.put(step(0))
    assert slow.writing.wait(WAIT_S)
    writer.put(step(1))  # returns while the first write waits
    assert not writer.failed()  # nothing failed: answered at once too
    assert slow.written == []
    slow.gate.set()
    writer.drain()
    assert written(slow) == [[0], [1]]


def test_steps_that_wait_are_written_as_one_in_order(slow: SlowRedis, writer: StepWriter) -> None:
    slow.gate.clear()
    writer.put(step(0))
    assert slow.writing.wait(WAIT_S)
    job = new_job()
    writer.put(step(1, 2, then="running"))
    writer.put(step(3, ended=job, then="ready"))
    slow.gate.set()
    writer.drain()
    # The two that waited in one write: their tokens in order, then the job's end, and their
    # metrics added together; the writes after each step (the runner's state) after all, in order.
    assert slow.written == [([0], [], 1.0), ([1, 2, 3], [job.id], 3.0)]
    assert slow.after == [[], [StateOf("running"), StateOf("ready")]]


def test_a_refused_write_is_kept_before_the_later_ones_and_tried_again_when_asked(
    slow: SlowRedis, writer: StepWriter
) -> None:
    slow.down = True
    writer.put(step(0))
    with pytest.raises(redis.ConnectionError):
        writer.drain()
    writer.put(step(1))
    assert writer.failed()
    with pytest.raises(redis.ConnectionError):  # still down: tried again, refused again
        writer.drain()
    assert slow.written == []
    slow.down = False
    assert writer.failed()
    writer.drain()  # the loop asks again: delivered, in order (the refused one alone first)
    assert written(slow) == [[0], [1]]


def test_a_write_that_landed_before_its_connection_dropped_is_not_written_again(
    slow: SlowRedis, writer: StepWriter
) -> None:
    """As when the master is killed between applying a step and replying, and its replica,
    which had the step, takes over: sent again, its tokens were in the stream twice."""
    slow.reply_lost = True
    writer.put(step(0))
    # The failure raises here, or this drain comes after it and tries again (and finds it).
    with contextlib.suppress(redis.ConnectionError):
        writer.drain()
    writer.put(step(1))
    writer.drain()
    assert written(slow) == [[0], [1]]
