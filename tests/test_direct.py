"""The direct hand-over (exo_tasks.direct), with real processes: a job whose runner has room
runs before its Celery message is delivered, and its task, delivered later, follows it and ends
as the job did. At the worst moment (the job on its runner, its message not yet taken) a
worker that dies loses nothing; a runner that filled up meanwhile leaves the job to Celery's
queue. Default settings throughout."""

from __future__ import annotations

import functools
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from exo_tasks import broker, direct, jobs
from exo_tasks.broker import queue_lists
from exo_tasks.celery_app import ExoCelery
from exo_tasks.commands import SubmitJob
from exo_tasks.fairness import client_of
from exo_tasks.fleet import Fleet
from exo_tasks.naming import host_queue, model_queue
from exo_tasks.recovery import HEARTBEAT_TTL_S, LOST_GRACE_S, SWEEP_INTERVAL_S
from exo_tasks.store.keys import DIRECT_TASKS_DUE, job_key, runner_key
from exo_tasks.store.runners import Room
from exo_tasks.types import JobRecord, JobRequest, JobStatus
from tests.support.api import api_settings
from tests.support.processes import Processes, RedisServer, wait_until
from tests.support.stack import Stack, new_worker, wait_tokens
from tests.support.workers import runner_state

# Long enough to be running when its worker dies, however loaded the machine.
MEDIUM = {"prompt": "medium", "max_tokens": 2000, "ignore_eos": True}
# From a lapsed heartbeat to the job requeued: the next sweeps (as tests/test_recovery.py).
REQUEUE_BOUND_S = HEARTBEAT_TTL_S + 15.0


def task_meta(stack: Stack, job_id: str) -> dict[str, Any] | None:
    """The job's task as Celery's result backend has it (None: no state stored yet)."""
    raw = stack.store.redis.get(f"celery-task-meta-{job_id}")
    return json.loads(raw) if raw else None


def task_succeeded(stack: Stack, job_id: str) -> dict[str, Any] | None:
    meta = task_meta(stack, job_id)
    return meta if meta is not None and meta["status"] == "SUCCESS" else None


def requeued_once(stack: Stack, job_id: str) -> JobRecord | None:
    job = stack.store.jobs.get(job_id)
    return job if job is not None and job.attempts == 1 else None


def waiting_in(stack: Stack, job_id: str, queue: str) -> bool:
    return job_id in broker.read_messages(stack.store.redis, [queue]).queued_task_ids


def test_jobs_run_before_their_tasks_are_delivered_and_their_tasks_then_follow_them(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    """The worker's main process frozen: it takes no message. A short job (1 token) ends
    meanwhile: its task is SUCCESS all the same, announced with no message (it succeeded before
    its task was due, EXO_DIRECT_TASK_DELAY_MS). A long one streams: its message waits (sent at
    once); once the worker thaws, its task follows it to its end and ends SUCCESS."""
    host = "dh-stopped"
    worker = new_worker(stack, processes, tiny_model, tmp_path, host)
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        # One token, the bench's job: it ends within milliseconds of its hand-over. A job of
        # 16, the most whose task waits, now and then took longer than the 100 ms in CI: its
        # task was then sent (rightly, it was still running), and no frozen worker ran it.
        short = stack.api.submit(prompt="direct", max_tokens=1, ignore_eos=True, host=host)
        job = stack.api.wait_job(short, timeout_s=HEARTBEAT_TTL_S / 2)
        assert job["status"] == "succeeded" and job["direct"] is True, job
        assert job["usage"]["completion_tokens"] == 1 and job["runner_id"] == f"tiny@{host}"
        meta = wait_until(functools.partial(task_succeeded, stack, short), 5, "its task")
        assert meta["result"] == {
            "job_id": short,
            "status": "succeeded",
            "finish_reason": "length",
            "tokens": 1,
            "runner": f"tiny@{host}",
        }
        long = stack.api.submit(**MEDIUM, host=host)
        wait_tokens(stack, long)
        # The long job's task has not run (its message is in the frozen worker's socket, if
        # Redis answered its waiting BRPOP, or still in its host's queue).
        assert task_meta(stack, long) is None
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    followed = f"job_id={long} runner=tiny@{host} direct=True"
    wait_until(lambda: followed in worker.log_text(), 10, "the long job's task to follow it")
    assert stack.api.wait_job(long)["status"] == "succeeded"
    meta = wait_until(functools.partial(task_succeeded, stack, long), 10, "its task")
    assert meta["result"]["status"] == "succeeded" and meta["result"]["job_id"] == long
    # The short job's task was never sent: the worker received the long job's alone.
    assert f"exo.inference[{long}] received" in worker.log_text()
    assert f"exo.inference[{short}] received" not in worker.log_text()


def test_a_worker_killed_before_its_directly_handed_job_is_delivered_loses_nothing(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    """The worst moment: the job streams on its runner, held by a worker that never took its
    message, and that worker is SIGKILLed (its runner goes with it). The recovery loop requeues
    the job from the worker's heartbeat; the host's next worker runs it to its end. A job
    submitted while the dead host's heartbeat still stands goes into its dead runner's inbox:
    it is requeued as well, and runs once, in its second attempt (the next runner of that name
    drops the inbox it inherits, which would have run the first attempt beside it)."""
    host = "dh-killed"
    worker = new_worker(stack, processes, tiny_model, tmp_path, host)
    runner = runner_state(stack.store, host)
    os.kill(worker.pid, signal.SIGSTOP)
    job_id = stack.api.submit(**MEDIUM, host=host)
    wait_tokens(stack, job_id)
    running = stack.store.jobs.get(job_id)
    assert running is not None and running.direct and running.owner is not None
    assert host in running.owner and task_meta(stack, job_id) is None
    worker.process.send_signal(signal.SIGKILL)
    assert runner.pid is not None
    wait_until(lambda: not psutil.pid_exists(runner.pid), 10, "its runner gone with it")
    late = stack.api.submit(prompt="late", max_tokens=4, ignore_eos=True, host=host)
    # No one reads it (the recovery loop's questions to the runner may wait there too).
    inbox = stack.store.redis.lrange(runner_key(runner.id, "inbox"), 0, -1)
    assert late in [json.loads(raw).get("job", {}).get("id") for raw in inbox]
    for requeued_id in (job_id, late):
        requeued = wait_until(
            functools.partial(requeued_once, stack, requeued_id), REQUEUE_BOUND_S, "its requeue"
        )
        assert requeued.status in (JobStatus.QUEUED, JobStatus.RUNNING) and not requeued.direct
    (tmp_path / "again").mkdir()
    new_worker(stack, processes, tiny_model, tmp_path / "again", host)
    for job_id_, tokens in ((job_id, MEDIUM["max_tokens"]), (late, 4)):
        job = stack.api.wait_job(job_id_, timeout_s=120)
        assert job["status"] == "succeeded" and job["attempts"] == 1, job
        assert job["usage"]["completion_tokens"] == tokens


@pytest.fixture
def celery(redis_server: RedisServer, tiny_model: Path) -> Iterator[ExoCelery]:
    app = ExoCelery(api_settings(redis_server.url, [tiny_model]))
    yield app
    app.close()


def test_a_runner_that_filled_up_meanwhile_leaves_the_job_to_celerys_queue(
    stack: Stack, celery: ExoCelery
) -> None:
    """The fleet as read said the runner had room; its jobs in Redis say it has none (a burst
    got there first): the job waits in its model's queue, and nothing is in the runner's
    inbox. A model no worker serves, so that the message stays where it was sent."""
    settings = celery.settings
    batch = settings.completion_batch_size
    room = Room(runner=batch, host=batch + 2, host_runners=("ghost@dh-ghost", "other@dh-ghost"))
    runner = direct.DirectRunner("ghost@dh-ghost", "dh-ghost", "dh-ghost:1:1", room)
    held, beside = (runner_key(r, "jobs") for r in room.host_runners)
    inbox = runner_key(runner.runner_id, "inbox")
    stack.store.redis.sadd(held, *[f"held-{i}" for i in range(batch)])
    where = jobs.Route("ghost", host_queue(runner.host), direct=runner)
    request = JobRequest.model_validate({"prompt": "hi", "max_tokens": 4})
    client = client_of("dh-ghost", None, None)
    submitted = []
    try:
        job = jobs.submit(stack.store, celery, settings, request, where=where, client=client)
        submitted.append(job)
        record = stack.store.jobs.get(job.id)
        assert record is not None and record.status == JobStatus.QUEUED and not record.direct
        assert waiting_in(stack, job.id, model_queue("ghost"))
        assert stack.store.redis.hget(job_key(job.id), "queue") == model_queue("ghost")
        assert stack.store.redis.llen(inbox) == 0
        # Room on the runner, none on its host (its other runner holds the rest of the pool).
        stack.store.redis.srem(held, "held-0")
        stack.store.redis.sadd(beside, "beside-0", "beside-1", "beside-2")
        refused = jobs.submit(stack.store, celery, settings, request, where=where, client=client)
        submitted.append(refused)
        assert waiting_in(stack, refused.id, model_queue("ghost"))
        # With room on both, the same route hands the next job over at once.
        stack.store.redis.srem(beside, "beside-0")
        handed = jobs.submit(stack.store, celery, settings, request, where=where, client=client)
        submitted.append(handed)
        # Its hand-over as the runner reads it (the record may be requeued by the time it is
        # read: no worker of that incarnation beats).
        command = SubmitJob.model_validate_json(stack.store.redis.lindex(inbox, 0))
        assert command.job.id == handed.id and command.job.direct
        assert command.job.owner == runner.owner and command.job.status == JobStatus.RUNNING
        assert waiting_in(stack, handed.id, host_queue(runner.host))
    finally:
        queues = [*queue_lists(model_queue("ghost")), *queue_lists(host_queue(runner.host))]
        stack.store.redis.delete(held, beside, inbox, *queues)
        for job in submitted:
            jobs.cancel(stack.store, job.id, jobs.CancelledBy.API, celery=None)


def test_the_tasks_of_an_api_process_that_died_before_they_were_due_are_sent_by_the_recovery_loop(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path, celery: ExoCelery
) -> None:
    """An API process hands short jobs over, then dies before their tasks are due (its `later`
    never runs): the recovery loop sends them, LOST_GRACE_S after they were due. A job that
    succeeded has its task announced SUCCESS, with no message; any other has its message
    sent, and its task ends as its job did (here FAILURE: the runner refused its prompt)."""
    host = "dh-orphans"
    worker = new_worker(stack, processes, tiny_model, tmp_path, host)
    settings = celery.settings
    client = client_of(host, None, None)

    def hand_over(prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "host": host}
        request = JobRequest.model_validate(body)
        where = jobs.route(Fleet.load(stack.store), settings, request, stack.store)
        job = jobs.submit(
            stack.store, celery, settings, request, where=where, client=client, later=dies
        )
        record = stack.store.jobs.get(job.id)
        assert record is not None and record.direct, record
        return job.id

    def dies(job_id: str, step: int) -> None:
        """The API process's own sending of the task, which it never lived to do."""

    succeeded = hand_over("orphan")
    # One token per character with the tiny model: over EXO_MAX_PROMPT_TOKENS (8192), which
    # only the runner counts.
    failed = hand_over("a" * 9000)
    assert stack.api.wait_job(succeeded)["status"] == "succeeded"
    assert stack.api.wait_job(failed)["status"] == "failed"
    assert task_meta(stack, succeeded) is None  # not yet: it was the API's to send
    bound_s = settings.direct_task_delay_ms / 1000 + LOST_GRACE_S + 2 * SWEEP_INTERVAL_S + 5
    meta = wait_until(
        functools.partial(task_succeeded, stack, succeeded), bound_s, "its task announced"
    )
    assert meta["result"]["job_id"] == succeeded and meta["result"]["tokens"] == 4
    meta = wait_until(
        lambda: (m := task_meta(stack, failed)) and m["status"] == "FAILURE" and m, 10, "its task"
    )
    assert "job failed" in meta["result"]["exc_message"][0]
    log = worker.log_text()
    assert f"exo.inference[{failed}] received" in log
    assert f"exo.inference[{succeeded}] received" not in log
    assert not {succeeded, failed} & set(stack.store.redis.zrange(DIRECT_TASKS_DUE, 0, -1))
