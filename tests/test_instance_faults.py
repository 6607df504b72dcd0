"""Faults and stops of an instance over two real workers (hosts a and b on one machine), with
the default settings: a rank that dies (its runner, its worker, its host's heartbeat) takes the
whole instance down within the decode stall limit + the kill escalation, every other rank
stopped by its own supervisor, the instance Failed naming the rank, the host and the cause, its
jobs failed with that cause; it starts again (a new generation) once all its hosts are live. A
warm shutdown drains, then stops every rank; a hard one stops them at once; no rank process
and no ring port survives either."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from config.settings import Settings
from exo_tasks.instances import InstanceRecord, InstanceStatus
from exo_tasks.recovery import HEARTBEAT_TTL_S
from exo_tasks.runner.sigterm import PATIENCE_S
from exo_tasks.worker.supervision import KILL_WAIT_S, TERM_WAIT_S
from tests.support.instances import (
    Pair,
    listening,
    pids_and_ports,
    submit,
    wait_gone,
)
from tests.support.processes import RedisServer, has_exited, wait_until
from tests.support.workers import Worker

DEFAULTS = Settings(_env_file=None)
# The bound for the ranks left behind: the decode stall limit + the kill escalation (a hung
# rank gets no grace: SIGTERM, 5 s, SIGKILL, 5 s).
STOP_BOUND_S = DEFAULTS.decode_timeout_s + TERM_WAIT_S + KILL_WAIT_S
LONG = {"prompt": "long", "max_tokens": 4000, "ignore_eos": True}
# A rank 0 blocked in a collective exits on SIGTERM once it has been blocked PATIENCE_S; well
# before the escalation's SIGKILL (TERM_WAIT_S after SIGTERM).
BLOCKED_EXIT_S = PATIENCE_S + 1.0


def running_job(pair: Pair) -> str:
    job_id = submit(pair, **LONG)
    wait_until(
        lambda: pair.store.streams.streamed_text(job_id)[1] >= 3, 30, "the job's first tokens"
    )
    return job_id


def assert_failed_with(pair: Pair, job_id: str, *causes: str) -> None:
    record = pair.wait_status(InstanceStatus.FAILED, 30)
    assert record.error is not None and all(c in record.error for c in causes), record.error
    job = wait_until(lambda: (j := pair.store.jobs.get(job_id)) and j.is_terminal and j, 30, "job")
    assert job.status == "failed" and job.error is not None
    assert all(c in job.error for c in causes), job.error


def assert_nothing_left(pair: Pair, pids: list[int], ports: list[int]) -> None:
    for pid in pids:
        wait_gone(pid, STOP_BOUND_S, f"rank process {pid}")
    wait_until(lambda: not any(listening(p) for p in ports), 5, "the ring ports closed")


def test_sigkill_of_rank_1_stops_rank_0_and_fails_the_instance_naming_rank_1(pair: Pair) -> None:
    before = pair.wait_ready()
    job_id = running_job(pair)
    pids, ports = pids_and_ports(before)
    os.kill(pids[1], signal.SIGKILL)
    took = wait_gone(pids[0], STOP_BOUND_S, "rank 0 stopped")
    print(f"rank 1 SIGKILLed: rank 0 gone in {took:.2f}s")
    assert_failed_with(pair, job_id, "rank 1 on host b", "signal 9 SIGKILL")
    assert_nothing_left(pair, pids, ports)
    after = pair.wait_ready(before.generation)
    assert after.generation > before.generation and took < STOP_BOUND_S


def test_sigkill_of_rank_0_stops_rank_1_and_fails_the_instance_naming_rank_0(pair: Pair) -> None:
    before = pair.wait_ready()
    job_id = running_job(pair)
    pids, ports = pids_and_ports(before)
    os.kill(pids[0], signal.SIGKILL)
    wait_gone(pids[1], STOP_BOUND_S, "rank 1 stopped")
    assert_failed_with(pair, job_id, "rank 0 on host a", "signal 9 SIGKILL")
    assert_nothing_left(pair, pids, ports)
    pair.wait_ready(before.generation)


def test_sigkill_of_a_rank_s_worker_fails_the_instance_until_the_host_is_back(
    pair: Pair,
) -> None:
    before = pair.wait_ready()
    job_id = running_job(pair)
    pids, ports = pids_and_ports(before)
    worker_b = pair.workers["b"].process
    os.kill(worker_b.pid, signal.SIGKILL)
    worker_b.wait(10)
    wait_gone(pids[0], STOP_BOUND_S, "rank 0 stopped")
    assert_failed_with(pair, job_id, "rank 1 on host b", f"worker (pid {worker_b.pid}) died")
    assert_nothing_left(pair, pids, ports)
    pair.restart_worker("b")
    pair.wait_ready(before.generation)


def freeze_host_b(pair: Pair) -> list[int]:
    """Host b gone silent: its worker and its rank stopped, their sockets open (no end of
    stream reaches rank 0, as when a host loses power). The pids to thaw."""
    frozen = [pair.workers["b"].pid, pair.rank_pid(1)]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    return frozen


def thaw(pair: Pair, frozen: list[int], before: InstanceRecord) -> None:
    for pid in frozen:
        os.kill(pid, signal.SIGCONT)
    wait_gone(frozen[1], STOP_BOUND_S, "rank 1 stopped once thawed")
    pair.wait_ready(before.generation)


def assert_stacks_logged(worker: Worker) -> None:
    """The hung rank's threads' stacks are in its worker's log, after the stall's line, down
    to the runner's own code."""
    log_text = worker.log_text()
    hung = log_text.rfind("runner is hung")
    assert hung >= 0, log_text[-3000:]
    dump = log_text[hung:]
    assert "(most recent call first)" in dump and "exo_tasks/runner/" in dump, dump[-3000:]


@pytest.mark.parametrize("busy", [True, False], ids=["mid-job", "idle"])
def test_a_host_gone_silent_takes_the_instance_down_within_its_bound(
    pair: Pair, busy: bool
) -> None:
    """Mid-job, rank 0 stalls in a collective and its own supervisor stops it (the decode stall
    limit + the kill escalation); idle, nothing stalls: host b's heartbeat expires, and rank 0
    is stopped then (the heartbeat TTL + the kill escalation). Either way the instance names
    host b, and so does the job that was running."""
    before = pair.wait_ready()
    job_id = running_job(pair) if busy else None
    pids, _ = pids_and_ports(before)
    frozen = freeze_host_b(pair)
    try:
        bound = STOP_BOUND_S if busy else HEARTBEAT_TTL_S + TERM_WAIT_S + KILL_WAIT_S
        took = wait_gone(pids[0], bound, "rank 0 stopped")
        print(f"host b silent ({'mid-job' if busy else 'idle'}): rank 0 gone in {took:.2f}s")
        record = pair.wait_status(InstanceStatus.FAILED, HEARTBEAT_TTL_S)
        assert record.error == "rank 1 on host b: its host's heartbeat is gone", record.error
        if job_id is not None:
            assert_stacks_logged(pair.workers["a"])
            job = wait_until(
                lambda: (j := pair.store.jobs.get(job_id)) and j.is_terminal and j, 10, "job"
            )
            assert job.status == "failed" and job.error is not None
            assert "rank 1 on host b: its host's heartbeat is gone" in job.error, job.error
        assert took < bound
    finally:
        thaw(pair, frozen, before)


# Redis paused longer than the decode stall limit, within its heartbeats' TTL.
REDIS_PAUSE_S = DEFAULTS.decode_timeout_s + 2.0


def test_a_paused_redis_as_jobs_end_is_no_hang_of_a_runner_or_an_instance(
    pair: Pair, redis_server: RedisServer
) -> None:
    """Redis paused (a stalled disk under `appendfsync always`, a frozen VM) while a short job
    ends beside a long one, on the instance and on a whole runner: the runner waits for Redis
    to publish its jobs' change. That wait used to count as silence: past the decode stall
    limit the whole runner was stopped as hung, its long job failed; rank 0 sent no plan, and
    rank 1, waiting for it, was stopped as hung with the instance. Now every job succeeds in
    its first attempt, the instance keeps its generation and no runner fails."""
    before = pair.wait_ready()
    ids: dict[str, list[str]] = {}
    for model in (before.model, "whole"):
        ids[model] = [
            pair.api.submit(model=model, prompt=f"long {model}", max_tokens=400, ignore_eos=True),
            pair.api.submit(model=model, prompt=f"short {model}", max_tokens=30, ignore_eos=True),
        ]
    every = [job_id for pair_ids in ids.values() for job_id in pair_ids]
    wait_until(
        lambda: all(pair.store.streams.streamed_text(j)[1] >= 3 for j in every), 30, "tokens"
    )
    redis_server.process.send_signal(signal.SIGSTOP)  # the short jobs end meanwhile
    try:
        time.sleep(REDIS_PAUSE_S)
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
    jobs = {job_id: pair.api.wait_job(job_id) for job_id in every}
    assert {(j["status"], j["attempts"]) for j in jobs.values()} == {("succeeded", 0)}, jobs
    assert [jobs[j]["usage"]["completion_tokens"] for j in every] == [400, 30, 400, 30]
    after = pair.instance()
    assert after.status == "Ready" and after.generation == before.generation, pair.explain(after)
    whole_runner = jobs[ids["whole"][0]]["runner_id"]
    statuses = [change.status for change in pair.store.runners.history(whole_runner)]
    assert "Failed" not in statuses, statuses


def test_sigterm_ends_rank_0_blocked_in_a_collective_well_before_sigkill(pair: Pair) -> None:
    """Rank 1 frozen mid-job: rank 0 blocks in its next collective, where no Python handler
    runs. A SIGTERM still ends it within BLOCKED_EXIT_S (it used to wait for SIGKILL), and the
    instance and its job say why."""
    before = pair.wait_ready()
    job_id = running_job(pair)
    pids, ports = pids_and_ports(before)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        # Well within the decode stall limit: rank 0's supervisor has not stopped it yet.
        time.sleep(1.0)
        assert not has_exited(pids[0])
        os.kill(pids[0], signal.SIGTERM)
        took = wait_gone(pids[0], STOP_BOUND_S, "rank 0 stopped")
        cause = "rank 0 on host a: exitcode=143 (SIGTERM)"
        record = pair.wait_status(InstanceStatus.FAILED, 10)
        assert record.error == cause, record.error
        job = wait_until(
            lambda: (j := pair.store.jobs.get(job_id)) and j.is_terminal and j, 10, "job"
        )
        assert job.status == "failed" and job.error is not None and cause in job.error, job.error
        print(f"rank 0 blocked in a collective: gone {took:.2f}s after SIGTERM")
        assert took < BLOCKED_EXIT_S, f"rank 0 took {took:.1f}s to exit on SIGTERM"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[1], signal.SIGCONT)
    assert_nothing_left(pair, pids, ports)
    pair.wait_ready(before.generation)


def test_a_warm_shutdown_drains_then_stops_every_rank(pair: Pair) -> None:
    before = pair.wait_ready()
    job_id = submit(pair, prompt="drain me", max_tokens=300, ignore_eos=True)
    wait_until(
        lambda: pair.store.streams.streamed_text(job_id)[1] >= 3, 30, "the job's first tokens"
    )
    pids, ports = pids_and_ports(before)
    pair.shut_down("warm")
    record = pair.wait_status(InstanceStatus.SHUTDOWN, DEFAULTS.runner_shutdown_grace_s + 10)
    job = pair.store.jobs.get(job_id)
    assert job is not None and job.status == "succeeded" and job.usage.completion_tokens == 300
    assert [r.status for r in record.ranks] == ["Shutdown", "Shutdown"], record.ranks
    assert_nothing_left(pair, pids, ports)
    pair.place_again()  # a new generation
    pair.wait_ready(before.generation)


def test_a_hard_shutdown_stops_every_rank_at_once(pair: Pair) -> None:
    before = pair.wait_ready()
    job_id = running_job(pair)
    pids, ports = pids_and_ports(before)
    started = time.monotonic()
    pair.shut_down("hard")
    for pid in pids:
        wait_gone(pid, TERM_WAIT_S + KILL_WAIT_S, f"rank process {pid}")
    took = time.monotonic() - started
    pair.wait_status(InstanceStatus.SHUTDOWN, 10)
    job = wait_until(lambda: (j := pair.store.jobs.get(job_id)) and j.is_terminal and j, 10, "job")
    assert job.status == "failed" and job.output.finish_reason == "shutdown", job
    assert_nothing_left(pair, pids, ports)
    assert took < TERM_WAIT_S + KILL_WAIT_S
    pair.place_again()
    pair.wait_ready(before.generation)


def test_a_warm_worker_shutdown_drains_the_instance_then_stops_every_rank(pair: Pair) -> None:
    """Worker b (rank 1) leaves warm: rank 0 finishes the job in flight, closes the ring, every
    rank exits 0; the instance is Failed naming host b, and starts again once b is back."""
    before = pair.wait_ready()
    job_id = submit(pair, prompt="drain me", max_tokens=200, ignore_eos=True)
    wait_until(
        lambda: pair.store.streams.streamed_text(job_id)[1] >= 3, 30, "the job's first tokens"
    )
    pids, ports = pids_and_ports(before)
    worker_b = pair.workers["b"].process
    worker_b.send_signal(signal.SIGTERM)
    worker_b.wait(DEFAULTS.runner_shutdown_grace_s + TERM_WAIT_S + KILL_WAIT_S)
    job = wait_until(lambda: (j := pair.store.jobs.get(job_id)) and j.is_terminal and j, 30, "job")
    assert job.status == "succeeded" and job.usage.completion_tokens == 200, job
    for pid in pids:
        # Within the escalation that bounds any stop once its jobs are done; each rank still
        # exits on its own (Shutdown, below), which takes well under it on a quiet machine.
        wait_gone(pid, TERM_WAIT_S + KILL_WAIT_S, f"rank process {pid}")
    record = pair.wait_status(InstanceStatus.FAILED, 10)
    assert record.error == "rank 1 on host b: its worker stopped", record.error
    assert [r.status for r in record.ranks] == ["Shutdown", "Shutdown"], record.ranks
    assert_nothing_left(pair, pids, ports)
    pair.restart_worker("b")
    pair.wait_ready(before.generation)
