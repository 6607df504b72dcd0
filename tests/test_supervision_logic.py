"""Pure pieces of supervision: exit causes, backoff, and the stall watchdog's verdicts."""

from __future__ import annotations

import multiprocessing
import time

from exo_tasks.runner.process import RunnerProgress
from exo_tasks.worker.supervision import exit_cause, restart_backoff_s


def test_exit_causes_use_exos_wording() -> None:
    assert exit_cause(-9) == "Terminated (signal 9 SIGKILL)"
    assert exit_cause(-15) == "Terminated (signal 15 SIGTERM)"
    assert exit_cause(1) == "exitcode=1"
    assert exit_cause(143) == "exitcode=143 (SIGTERM)"  # a runner that exited on SIGTERM itself
    assert exit_cause(0) == "exitcode=0"


def test_restart_backoff_doubles_up_to_30s() -> None:
    assert [restart_backoff_s(n) for n in (1, 2, 3, 4, 7, 20)] == [0.5, 1, 2, 4, 30, 30]


def progress(last_ago_s: float, active: int, awaiting_first: int) -> RunnerProgress:
    shared = RunnerProgress.create(multiprocessing.get_context("spawn"))
    shared.record(active=active, awaiting_first_token=awaiting_first, progressed=True)
    shared.array[0] = time.monotonic() - last_ago_s
    return shared


def test_an_idle_runner_never_stalls() -> None:
    assert progress(3600, active=0, awaiting_first=0).stall(60, 5) is None


def test_a_job_waiting_for_its_first_token_gets_the_prefill_timeout() -> None:
    assert progress(30, active=2, awaiting_first=1).stall(60, 5) is None
    verdict = progress(61, active=2, awaiting_first=1).stall(60, 5)
    assert verdict is not None and verdict.startswith("stalled in prefill (no first token for 61")


def test_decoding_jobs_get_the_decode_timeout() -> None:
    assert progress(4, active=3, awaiting_first=0).stall(60, 5) is None
    verdict = progress(6, active=3, awaiting_first=0).stall(60, 5)
    assert verdict is not None and verdict.startswith("stalled in decode (no token for 6")


def test_a_wait_for_redis_is_not_silence() -> None:
    """A runner inside a wait for Redis (a paused or slow Redis) is not hung, however long the
    wait up to the prefill limit; the silence before the wait still counts, and the wait is
    taken off it once over."""
    shared = progress(4.5, active=3, awaiting_first=0)
    with shared.waiting_for_redis():
        time.sleep(1.0)  # past the decode limit, were the wait silence
        assert shared.stall(60, 5) is None
        shared.array[3] -= 60  # as if it had waited 61 s: longer than any call's timeouts
        verdict = shared.stall(60, 5)
        assert verdict is not None and verdict.startswith("stalled waiting for Redis (61")
    assert shared.stall(60, 5) is None  # the second it waited is taken off the silence
    shared.array[0] -= 1
    verdict = shared.stall(60, 5)
    assert verdict is not None and verdict.startswith("stalled in decode (no token for 5.5")
    before = progress(6, active=3, awaiting_first=0)
    with before.waiting_for_redis():  # silent past the limit before it began to wait
        assert (before.stall(60, 5) or "").startswith("stalled in decode")
