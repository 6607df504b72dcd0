"""A job whose ending a Redis failover lost (docs/ha.md): asynchronous replication hands the new
master the job as it was before its runner ended it, `running` under a live worker that no
longer runs it. The recovery loop asks its runner, which requeues it; it runs again and ends
once, with its whole text, within seconds (before: at its soft limit, 600 s, or never).

The lost write is made here the way a replica lacking it would have it: the job's hash as it
was while running, and its end event gone from its streams, right after its runner ended it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from exo_tasks.naming import runner_id_for
from exo_tasks.store import Store
from exo_tasks.store.keys import ACTIVE_JOBS, endings_key, events_key, job_key, runner_key
from tests.support.api import api_settings, serving
from tests.support.processes import Processes, RedisServer, wait_until
from tests.support.stack import Stack, idle, wait_tokens
from tests.support.workers import Worker, new_worker, runner_state

HOST = "lost-end"
# Long enough to be read running between two polls of a loaded machine (300 tokens were not,
# once on CI: a job handed over as it is submitted starts at once).
LOST = {"prompt": "lost", "max_tokens": 600, "ignore_eos": True, "host": HOST}
BYSTANDER = {"prompt": "bystander", "max_tokens": 4000, "ignore_eos": True, "host": HOST}
# From the lost write to the job's second ending: a sweep (2 s) to ask its runner, the
# requeue, the message back (or sent again at the next sweep), and the 600 tokens again.
ENDED_AGAIN_S = 10.0


@pytest.fixture(scope="module")
def lost_end(
    redis_server: RedisServer,
    store: Store,
    module_processes: Processes,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    """The module's own host and API on the session's Redis (not the session's stack: the
    module runs in the lane 'own' of tests/support/lanes.py)."""
    data_dir = tmp_path_factory.mktemp("lost-end")
    worker = new_worker(module_processes, redis_server.url, store, HOST, [tiny_model], data_dir)
    with serving(api_settings(redis_server.url, [tiny_model])) as api:
        yield Stack(redis=redis_server, store=store, worker=worker, api=api)


def running(stack: Stack, job_id: str) -> dict[str, str]:
    """The job's hash once its runner has it (a few tokens in)."""
    wait_tokens(stack, job_id)
    snapshot: dict[str, str] = stack.store.redis.hgetall(job_key(job_id))
    assert snapshot["status"] == "running"
    return snapshot


def lose_the_ending(stack: Stack, job_id: str, snapshot: dict[str, str]) -> None:
    """The job as a replica without its ending's write has it: running, its end event gone."""
    redis = stack.store.redis
    ended = [
        (key, entry)
        for key in (events_key(job_id), endings_key(job_id))
        for entry, fields in redis.xrange(key)
        if fields["event"] in ("done", "error")
    ]
    assert len(ended) == 2
    pipe = redis.pipeline(transaction=True)
    pipe.hset(job_key(job_id), mapping=snapshot)
    pipe.sadd(ACTIVE_JOBS, job_id)
    pipe.sadd(runner_key(runner_id_for("tiny", HOST), "jobs"), job_id)
    for key, entry in ended:
        pipe.xdel(key, entry)
    pipe.execute()


def ended_again(stack: Stack, job_id: str, lost_at: float) -> None:
    """How long after the lost write the job ended again (printed: its requeue's time too)."""

    def ended() -> bool:
        job = stack.store.jobs.get(job_id)
        return job is not None and job.is_terminal

    wait_until(ended, ENDED_AGAIN_S, f"job {job_id} to end again", interval_s=0.02)
    took_s = time.monotonic() - lost_at
    seconds, micros = stack.store.redis.time()  # a stream id is Redis's clock, in ms
    now_ms = seconds * 1000 + micros // 1000
    requeued_s = took_s - (now_ms - event_ms(stack, job_id, "requeued")) / 1000
    print(f"{job_id}: requeued {requeued_s:.1f} s after its ending was lost, ended {took_s:.1f} s")


def assert_ended_once(stack: Stack, job_id: str, attempts: int, text: str | None = None) -> None:
    """Succeeded once, every token (one `done` on its stream), after `attempts` requeues."""
    job = stack.api.wait_job(job_id, timeout_s=120)
    assert (job["status"], job["attempts"]) == ("succeeded", attempts)
    request = stack.store.jobs.get(job_id)
    assert request is not None
    assert job["usage"]["completion_tokens"] == request.request.max_tokens
    assert text is None or job["output"]["text"] == text
    names = [event.event for _, event in stack.store.streams.read_events(job_id)]
    assert names.count("done") == 1 and names.count("requeued") == attempts


def event_ms(stack: Stack, job_id: str, name: str) -> int:
    """When the job's one event `name` was written: its stream id, Redis's clock in ms."""
    [entry] = [e for e, event in stack.store.streams.read_events(job_id) if event.event == name]
    return int(entry.split("-")[0])


def assert_held_through_the_recovery(stack: Stack, bystander: str, lost: str) -> None:
    """The bystander was on the runner when the recovery had the runner check its jobs (and
    requeue `lost`): it runs still, or its last token came after that requeue. (A fast
    machine ends it before a loaded one has finished the recovery.)"""
    job = stack.store.jobs.get(bystander)
    assert job is not None
    if job.status != "running":
        assert event_ms(stack, bystander, "done") > event_ms(stack, lost, "requeued"), job


@contextmanager
def tasks_paused(stack: Stack, worker: Worker) -> Iterator[None]:
    """The worker's pool children stopped, their Redis connections cut (as a failover cuts
    them), so a task waiting on a job sees nothing until it goes on, from where it had read."""
    runner_pid = runner_state(stack.store, HOST).pid
    children = [c for c in psutil.Process(worker.pid).children() if c.pid != runner_pid]
    assert children
    for child in children:
        os.kill(child.pid, signal.SIGSTOP)
    try:
        ports = {
            f"{c.laddr.ip}:{c.laddr.port}"
            for child in children
            for c in child.net_connections(kind="tcp")
            if c.raddr and c.raddr.port == stack.redis.port
        }
        for client in stack.store.redis.client_list():
            if client["addr"] in ports:
                stack.store.redis.client_kill_filter(_id=client["id"])
        yield
    finally:
        for child in children:
            os.kill(child.pid, signal.SIGCONT)


def test_an_ending_lost_after_its_task_saw_it_is_run_again(lost_end: Stack) -> None:
    stack, worker = lost_end, lost_end.worker
    # The task read the ending before the master died, and returned: nothing follows the job.
    idle(stack, worker)
    bystander = stack.api.submit(**BYSTANDER)
    lost = stack.api.submit(**LOST)
    snapshot = running(stack, lost)
    first = stack.api.wait_job(lost, timeout_s=30)
    assert first["status"] == "succeeded"
    lose_the_ending(stack, lost, snapshot)
    ended_again(stack, lost, time.monotonic())
    assert_ended_once(stack, lost, attempts=1, text=first["output"]["text"])
    assert_held_through_the_recovery(stack, bystander, lost)
    assert_ended_once(stack, bystander, attempts=0)


def test_an_ending_lost_before_its_task_saw_it_is_run_again(lost_end: Stack) -> None:
    stack, worker = lost_end, lost_end.worker
    # The master died before the task read the ending: the task waits on the new master.
    idle(stack, worker)
    bystander = stack.api.submit(**BYSTANDER)
    lost = stack.api.submit(**LOST)
    snapshot = running(stack, lost)
    with tasks_paused(stack, worker):
        wait_until(
            lambda: stack.store.jobs.get(lost).is_terminal,  # type: ignore[union-attr]
            30,
            "the runner to end the job",
        )
        first = stack.store.jobs.get(lost)
        assert first is not None and first.status == "succeeded"
        lose_the_ending(stack, lost, snapshot)
        lost_at = time.monotonic()
    ended_again(stack, lost, lost_at)
    assert_ended_once(stack, lost, attempts=1, text=first.output.text)
    assert_held_through_the_recovery(stack, bystander, lost)
    assert_ended_once(stack, bystander, attempts=0)
