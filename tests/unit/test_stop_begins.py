"""How a worker's stop begins (exo_tasks.worker.stop_begins): once per kind, and for a cold
signal before Celery's own handler. Real signals to this process."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

import billiard.pool
import pytest

from exo_tasks.worker.stop_begins import StopBegins, bound_result_wait, run_first
from tests.support.processes import wait_until

SIG = signal.SIGUSR1


@pytest.fixture
def calls() -> Iterator[list[str]]:
    """SIG handled by a stand-in for Celery's handler, which records its calls in the list."""
    made: list[str] = []

    def celery_handler(signum: int, frame: FrameType | None) -> None:
        made.append("celery")

    previous = signal.signal(SIG, celery_handler)
    try:
        yield made
    finally:
        signal.signal(SIG, previous)


def test_run_first_calls_ours_before_the_installed_handler(calls: list[str]) -> None:
    run_first(SIG, lambda: calls.append("ours"))
    os.kill(os.getpid(), SIG)
    assert calls == ["ours", "celery"]


def test_run_first_wraps_once_for_the_same_callback(calls: list[str]) -> None:
    stop = StopBegins(threading.Event(), lambda window_s: None, 30.0, lambda cold: None)
    run_first(SIG, stop.cold)
    run_first(SIG, stop.cold)
    wrapped = signal.getsignal(SIG)
    run_first(SIG, stop.cold)
    assert signal.getsignal(SIG) is wrapped


def begins() -> tuple[StopBegins, list[float], list[bool]]:
    drains: list[float] = []
    left: list[bool] = []
    stop = StopBegins(threading.Event(), drains.append, 30.0, left.append)
    return stop, drains, left


def test_each_kind_of_stop_begins_once_and_a_cold_one_drains_now() -> None:
    stop, drains, left = begins()
    stop("Warm", sig="SIGTERM")
    stop("Warm", sig="SIGINT")
    stop("Cold")
    stop("Cold", sig="SIGQUIT")
    assert stop.stopping.is_set()
    assert drains == [30.0, 0.0]
    wait_until(lambda: len(left) == 2, 5, "both stops to leave (each in its own thread)")
    assert sorted(left) == [False, True]


def test_a_warm_stop_by_ctrl_c_makes_the_next_ctrl_c_cold_first() -> None:
    stop = begins()[0]

    def celery_handler(signum: int, frame: FrameType | None) -> None:
        """Celery's (pytest-xdist's workers ignore SIGINT: nothing to wrap)."""

    previous = signal.signal(signal.SIGINT, celery_handler)
    try:
        stop("Warm", sig="SIGTERM")
        assert signal.getsignal(signal.SIGINT) is celery_handler  # after SIGTERM: Celery's
        stop("Warm", sig="SIGINT")
        assert getattr(signal.getsignal(signal.SIGINT), "runs_first", None) == stop.cold
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_pool_child_waits_at_most_a_second_for_its_results_to_be_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(billiard.pool, "GUARANTEE_MESSAGE_CONSUMPTION_RETRY_LIMIT", 300)
    bound_result_wait()
    waits = billiard.pool.GUARANTEE_MESSAGE_CONSUMPTION_RETRY_LIMIT
    assert waits * billiard.pool.GUARANTEE_MESSAGE_CONSUMPTION_RETRY_INTERVAL == pytest.approx(1.0)
