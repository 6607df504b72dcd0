"""The store's one-round-trip scripts on a real redis-server: the job's creation against its
queue's cap and its client's quota, with its priority step, the hand-over to a runner, and the
endings stream a task waits on."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from exo_tasks import broker, fairness, lifecycle
from exo_tasks.commands import SubmitJob
from exo_tasks.metrics import Observations
from exo_tasks.store import Store
from exo_tasks.store.keys import RECENT_JOBS
from exo_tasks.types import JobRecord, JobRequest, JobStatus, TokenEvent, utcnow
from tests.support.processes import Processes, start_redis


def new_job(model: str = "m") -> JobRecord:
    request = JobRequest.model_validate({"prompt": "hi", "max_tokens": 4})
    return JobRecord(id=uuid.uuid4().hex, model=model, request=request)


def running(job: JobRecord, runner_id: str, owner: str = "w:1:1") -> SubmitJob:
    started = job.model_copy(
        update={
            "status": JobStatus.RUNNING,
            "started_at": utcnow(),
            "runner_id": runner_id,
            "host": "w",
            "owner": owner,
        }
    )
    return SubmitJob(job=started, soft_deadline=time.time() + 30, deadline=time.time() + 60)


def test_a_job_is_created_only_while_its_queue_has_room(store: Store) -> None:
    queue = f"exo.model.cap-{uuid.uuid4().hex[:6]}"
    store.redis.lpush(queue, "a")
    store.redis.lpush(f"{queue}\x06\x165", "b")  # kombu's list for priority 5

    first, second = new_job(), new_job()
    assert store.jobs.create(first, queue, max_queued=3).depth == 2
    assert store.jobs.get(first.id) == first
    refused = store.jobs.create(second, queue, max_queued=2)
    assert refused.depth == 2 and refused.step is None
    assert store.jobs.get(second.id) is None


def new_job_of(priority: str) -> JobRecord:
    request = JobRequest.model_validate({"prompt": "hi", "max_tokens": 4, "priority": priority})
    return JobRecord(id=uuid.uuid4().hex, model="m", request=request)


def test_a_clients_jobs_wait_at_later_steps_of_their_class_up_to_its_quota(store: Store) -> None:
    queue = f"exo.model.fair-{uuid.uuid4().hex[:6]}"
    a, b = (fairness.client_of(f"{name}-{uuid.uuid4().hex[:6]}", None, None).key for name in "ab")
    a_jobs = [new_job_of("normal") for _ in range(5)]
    steps = [store.jobs.create(job, queue, 1_000, a, quota=5).step for job in a_jobs]
    # Its first job at the class's first step, then one step later at 1, 2 and 4 waiting.
    assert steps == [3, 4, 5, 5, 6]
    assert [store.jobs.queue_priority(job.id) for job in a_jobs] == steps

    # At its quota (all classes count): refused, while another client's first job goes first.
    over = store.jobs.create(new_job_of("high"), queue, 1_000, a, quota=5)
    assert over.step is None and over.client_waiting == 5
    assert store.jobs.create(new_job_of("normal"), queue, 1_000, b, quota=5).step == 3
    assert store.jobs.create(new_job_of("low"), queue, 1_000, b, quota=5).step == 7

    # A job that leaves the queue (a runner took it, or it was cancelled) leaves the count.
    assert store.runners.hand_over("m@fair", running(a_jobs[0], "m@fair"))
    assert store.jobs.apply(lifecycle.cancel_queued(a_jobs[1]))
    assert store.jobs.client_waiting(a) == 3
    assert store.jobs.create(new_job_of("normal"), queue, 1_000, a, quota=5).step == 5


def test_hand_over_marks_a_queued_job_running_and_fills_the_inbox(store: Store) -> None:
    runner_id = f"m@{uuid.uuid4().hex[:6]}"
    job = new_job()
    store.jobs.create(job, "exo.model.m", max_queued=1_000)

    assert store.runners.hand_over(runner_id, running(job, runner_id))
    stored = store.jobs.get(job.id)
    assert stored is not None and stored.status == "running" and stored.runner_id == runner_id
    command = store.runners.next_command(runner_id, timeout_s=1)
    assert isinstance(command, SubmitJob) and command.job.id == job.id
    assert store.runners.take_jobs(runner_id) == [job.id]


def test_hand_over_leaves_a_cancelled_job_alone(store: Store) -> None:
    runner_id = f"m@{uuid.uuid4().hex[:6]}"
    job = new_job()
    store.jobs.create(job, "exo.model.m", max_queued=1_000)
    move = lifecycle.cancel_queued(job)
    assert store.jobs.apply(move)
    cancelled = move.record

    assert not store.runners.hand_over(runner_id, running(job, runner_id))
    assert store.jobs.get(job.id) == cancelled
    assert store.runners.next_command(runner_id, timeout_s=0.1) is None
    assert store.runners.take_jobs(runner_id) == []


def test_endings_hold_each_attempts_end_and_no_tokens(store: Store) -> None:
    job = new_job()
    store.jobs.create(job, "exo.model.m", max_queued=1_000)
    runner_id = "m@endings"
    store.runners.hand_over(runner_id, running(job, runner_id))
    store.jobs.write_step(
        runner_id, [(job.id, TokenEvent(index=0, text="a"))], Observations(), [], [], "step-1"
    )
    assert store.jobs.step_written(runner_id, "step-1")
    assert not store.jobs.step_written(runner_id, "step-2")
    requeued = store.jobs.requeue(job.id)
    assert requeued is not None and requeued.attempts == 1

    after, events_before = store.streams.attempt_start(job.id)
    assert events_before == 2  # the first attempt's token and its requeue
    [(first_end, ending)] = store.streams.read_endings(job.id, "0-0", block_ms=100)
    assert first_end == after and ending.event == "requeued"

    store.runners.hand_over(runner_id, running(requeued, runner_id))
    final = requeued.ended(
        JobStatus.SUCCEEDED, text="b", finish_reason="length", completion_tokens=1
    )
    store.jobs.write_step(
        runner_id, [(job.id, TokenEvent(index=0, text="b"))], Observations(), [final], [], "step-2"
    )
    [(_, ending)] = store.streams.read_endings(job.id, after, block_ms=100)
    assert ending.event == "done" and ending.job.output.text == "b"
    _, events = store.streams.runner_and_events(runner_id, job.id)
    assert events - events_before == 2  # this attempt's token and its done


def test_an_ending_is_counted_in_the_write_that_ends_the_job_and_once(store: Store) -> None:
    """Its metrics go with the move (a scrape that reads the job ended counts it); a second
    ending, which loses (first writer wins), counts nothing."""
    model = f"counted-{uuid.uuid4().hex[:6]}"
    by_runner, from_outside = new_job(model), new_job(model)
    for job in (by_runner, from_outside):
        store.jobs.create(job, "exo.model.m", max_queued=1_000)
        store.runners.hand_over("m@counted", running(job, "m@counted"))
    final = store.jobs.get(by_runner.id)
    assert final is not None
    final = final.ended(JobStatus.SUCCEEDED, text="a", finish_reason="stop", completion_tokens=1)
    store.jobs.write_step("m@counted", [], Observations(), [final], [], "counted-1")
    assert store.jobs.fail(from_outside.id, "the test's")
    assert not store.jobs.fail(by_runner.id, "too late")  # the runner's ending was first
    store.jobs.write_step("m@counted", [], Observations(), [final], [], "counted-2")  # again

    stored = store.metrics.read()
    ended = stored["exo_request_success_total"]
    assert {k: v for k, v in ended.items() if model in k} == {
        json.dumps([model, "succeeded"]): "1",
        json.dumps([model, "failed"]): "1",
    }
    assert stored["exo_generation_tokens_total"][json.dumps([model])] == "1"


def test_a_requeue_for_a_dead_owner_never_takes_the_job_from_a_newer_attempt(
    store: Store,
) -> None:
    job = new_job()
    store.jobs.create(job, "exo.model.m", max_queued=1_000)
    assert job.id in {j.id for j in store.jobs.active()}
    store.runners.hand_over("m@w", running(job, "m@w", owner="w:1:1"))
    first = store.jobs.requeue(job.id, only_from="w:1:1")
    assert first is not None and first.status == "queued" and first.owner is None
    store.runners.hand_over("m@w", running(first, "m@w", owner="w:2:2"))  # a new attempt took it

    assert store.jobs.requeue(job.id, only_from="w:1:1") is None  # the old owner's: too late
    stored = store.jobs.get(job.id)
    assert stored is not None and stored.status == "running" and stored.owner == "w:2:2"


def test_a_cancelled_job_ends_cancelled_instead_of_going_back_to_the_queue(store: Store) -> None:
    job = new_job()
    store.jobs.create(job, "exo.model.m", max_queued=1_000)
    store.runners.hand_over("m@w", running(job, "m@w"))
    store.jobs.write_step(
        "m@w", [(job.id, TokenEvent(index=0, text="a"))], Observations(), [], [], "step-1"
    )
    store.jobs.request_cancel(job.id, "the test")

    assert store.jobs.requeue(job.id) is None
    stored = store.jobs.get(job.id)
    assert stored is not None and stored.status == "cancelled"
    assert stored.output.text == "a" and stored.output.finish_reason == "cancelled"
    assert job.id not in {j.id for j in store.jobs.active()}


def test_the_recovery_lease_has_one_holder_until_it_lapses(
    processes: Processes, tmp_path: Path
) -> None:
    # A Redis of its own: the session's workers run recovery loops that take the lease too.
    store = Store.from_url(start_redis(processes, tmp_path / "redis").url)
    assert store.hosts.hold_lease("a", 0.3)
    assert store.hosts.hold_lease("a", 0.3)  # renewed
    assert not store.hosts.hold_lease("b", 0.3)
    time.sleep(0.4)
    assert store.hosts.hold_lease("b", 0.3)


def test_foreign_entries_in_a_queue_do_not_hide_celery_messages(store: Store) -> None:
    queue = f"exo.model.junk-{uuid.uuid4().hex[:6]}"
    store.redis.lpush(queue, "not json", '{"headers": {"id": "task-1"}}', "[1, 2]")
    assert broker.read_messages(store.redis, [queue]).queued_task_ids == {"task-1"}


def test_queued_or_running_jobs_are_listed_from_the_active_ones_newest_first(
    processes: Processes, tmp_path: Path
) -> None:
    # A Redis of its own: the commands it serves are counted.
    store = Store.from_url(start_redis(processes, tmp_path / "redis").url)
    ended = [new_job() for _ in range(300)]
    for job in ended:
        store.jobs.create(job, "exo.model.m", max_queued=1_000)
        assert store.jobs.apply(lifecycle.cancel_queued(job))
    runs = [new_job() for _ in range(3)]
    for job in runs:
        time.sleep(0.002)  # distinct creation times: the index's order
        store.jobs.create(job, "exo.model.m", max_queued=1_000)
        assert store.runners.hand_over("m@w", running(job, "m@w"))
    waiting, dropped = new_job(), new_job()
    store.jobs.create(waiting, "exo.model.m", max_queued=1_000)
    # Running still, but past the recent index (RECENT_JOBS_KEPT newer jobs): not listed.
    store.jobs.create(dropped, "exo.model.m", max_queued=1_000)
    assert store.runners.hand_over("m@w", running(dropped, "m@w"))
    store.redis.zrem(RECENT_JOBS, dropped.id)

    store.redis.config_resetstat()
    newest = store.jobs.recent(status="running", limit=2)
    rest = store.jobs.recent(status="running", limit=2, before=runs[1].id)
    queued = store.jobs.recent(status="queued")
    assert newest is not None and rest is not None and queued is not None
    assert [j.id for j in newest] == [runs[2].id, runs[1].id]
    assert [j.id for j in rest] == [runs[0].id]
    assert [j.id for j in queued] == [waiting.id]
    # Only the 4 active jobs' records were read (each listing at most), not the 300 ended ones.
    assert store.redis.info("commandstats")["cmdstat_hget"]["calls"] <= 4 * 3
    cancelled = store.jobs.recent(status="cancelled", limit=1_000)
    assert cancelled is not None and {j.id for j in cancelled} == {j.id for j in ended}
