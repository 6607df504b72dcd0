"""The inference task's rules (exo_tasks.worker.tasks), against a fake store and a fake task:
what a delivery prepares, the hand-over, following a job to its end, the soft and hard time
limits, and when a message is rejected and requeued. One class per step and one rule per test,
in the style of Celery's own unit tests of its worker's Request; the real-process tests run
the same code for real."""

from __future__ import annotations

from typing import Any, cast

import pytest
import redis
from celery.exceptions import Reject, SoftTimeLimitExceeded, TimeLimitExceeded
from kombu.exceptions import DecodeError

from exo_tasks import jobs, lifecycle
from exo_tasks.commands import CancelJob, RunnerCommand, StartRunnerRequest, SubmitJob
from exo_tasks.errors import RunnerGone
from exo_tasks.fleet_types import RunnerStatus
from exo_tasks.naming import host_queue, model_queue
from exo_tasks.types import DoneEvent, JobEnding, JobRecord, JobStatus, utcnow
from exo_tasks.worker import tasks
from exo_tasks.worker.task_states import JobEnded
from tests.unit.fakes import (
    HOST,
    INCARNATION,
    RUNNER_ID,
    FakeClock,
    FakeStore,
    FakeTask,
    clock_of,
    new_job,
    runner,
)

RS = JobStatus
# The task's body, called with a fake task as its `self` (Celery binds it to the real one).
inference = cast(Any, tasks.inference).__wrapped__.__func__


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The tasks' clock: their waits (in slices, for the runner, for Redis) pass at once."""
    return clock_of(monkeypatch, tasks)


@pytest.fixture
def store(clock: FakeClock) -> FakeStore:
    fake = FakeStore(clock)
    fake.runners.states[RUNNER_ID] = runner()
    return fake


def running_elsewhere(owner: str) -> JobRecord:
    return new_job(status=RS.RUNNING, owner=owner, host="other", runner_id="tiny@other")


def ends_jobs_it_is_told_to_cancel(store: FakeStore) -> None:
    """The runner's answer to a cancel: the job ends at its next step."""

    def answer(runner_id: str, command: RunnerCommand) -> None:
        if isinstance(command, CancelJob):
            status = RS.TIMED_OUT if command.reason == "time_limit" else RS.CANCELLED
            store.jobs.end(command.job_id, status, finish_reason=command.reason)

    store.runners.on_send = answer


class TestPrepare:
    def test_an_unknown_or_expired_job_is_skipped(self, store: FakeStore) -> None:
        assert tasks._prepare(store.as_store, "nope", RUNNER_ID, INCARNATION) == tasks.Skipped(None)

    def test_an_ended_job_is_skipped_with_its_record(self, store: FakeStore) -> None:
        job = store.jobs.add(new_job(status=RS.CANCELLED))
        assert tasks._prepare(store.as_store, job.id, RUNNER_ID, INCARNATION) == tasks.Skipped(job)

    def test_a_job_running_on_a_live_worker_is_a_duplicate_and_left_alone(
        self, store: FakeStore
    ) -> None:
        store.hosts.live_owners.add("other:2:2")
        job = store.jobs.add(running_elsewhere("other:2:2"))
        assert tasks._prepare(store.as_store, job.id, RUNNER_ID, INCARNATION) == tasks.Skipped(job)
        assert store.jobs.records[job.id] == job

    def test_a_job_this_worker_runs_is_left_alone_though_its_heartbeat_expired(
        self, store: FakeStore
    ) -> None:
        """Redis down longer than the heartbeat's TTL: on reconnecting, kombu gives back the
        message this worker held, before its next beat; the job runs here all along."""
        store.hosts.live_owners.clear()
        job = store.jobs.add(new_job(status=RS.RUNNING, owner=INCARNATION, host=HOST))
        assert tasks._prepare(store.as_store, job.id, RUNNER_ID, INCARNATION) == tasks.Skipped(job)
        assert store.jobs.records[job.id] == job

    def test_a_job_running_on_a_dead_worker_is_requeued_and_run(
        self, store: FakeStore, clock: FakeClock
    ) -> None:
        """Its host silent: given two beats to show it lives, then taken for gone."""
        job = store.jobs.add(running_elsewhere("other:1:1"))
        prepared = tasks._prepare(store.as_store, job.id, RUNNER_ID, INCARNATION)
        assert isinstance(prepared, tasks.Prepared)
        assert (prepared.job.status, prepared.job.attempts) == (RS.QUEUED, 1)
        assert prepared.runner == store.runners.states[RUNNER_ID]
        assert clock.now - clock.START >= tasks.OWNER_BEAT_WAIT_S

    def test_a_job_whose_worker_was_restarted_is_requeued_at_once(
        self, store: FakeStore, clock: FakeClock
    ) -> None:
        store.hosts.live_owners.add("other:2:2")  # another incarnation beats on its host
        job = store.jobs.add(running_elsewhere("other:1:1"))
        prepared = tasks._prepare(store.as_store, job.id, RUNNER_ID, INCARNATION)
        assert isinstance(prepared, tasks.Prepared) and prepared.job.attempts == 1
        assert clock.now == clock.START

    def test_a_job_whose_silent_worker_beats_again_is_left_alone(
        self, store: FakeStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Redis down longer than the heartbeat's TTL, seen from another worker: the holder's
        kombu gave its message back as it reconnected, and it reached this worker a beat before
        the holder's next heartbeat. The job runs there all along."""
        job = store.jobs.add(running_elsewhere("other:1:1"))
        beats_from = clock.now + 1.5

        def beats(host: str) -> str | None:
            return host if clock.now >= beats_from else None

        monkeypatch.setattr(store.hosts, "get", beats)
        monkeypatch.setattr(store.hosts, "owner_is_live", lambda job: beats("other") is not None)
        assert tasks._prepare(store.as_store, job.id, RUNNER_ID, INCARNATION) == tasks.Skipped(job)
        assert store.jobs.records[job.id] == job

    def test_a_job_handed_over_at_its_submission_is_followed_not_handed_over_again(
        self, store: FakeStore
    ) -> None:
        """exo_tasks.direct: the API put the job in the runner's inbox, held by this worker;
        its message comes later, and its task follows the job to its ending."""
        job = lifecycle.start(new_job(), host=HOST, runner_id=RUNNER_ID, owner=INCARNATION)
        job = store.jobs.add(job.model_copy(update={"direct": True}))
        prepared = tasks._prepare(store.as_store, job.id, RUNNER_ID, INCARNATION)
        assert prepared == tasks.Prepared(job, store.runners.states[RUNNER_ID], handed_over=True)
        final = job.ended(RS.SUCCEEDED, text="hi", finish_reason="length", completion_tokens=4)
        store.streams.append(job.id, DoneEvent(event="done", job=final))
        result = inference(FakeTask(store), job.id, "tiny")
        assert (result["job_id"], result["status"]) == (job.id, RS.SUCCEEDED)
        assert store.runners.inboxes[RUNNER_ID] == []  # not handed over a second time

    def test_a_job_handed_over_at_its_submission_whose_worker_restarted_is_requeued(
        self, store: FakeStore
    ) -> None:
        """Its holder (this host's previous worker) is gone before the message came: the
        delivery requeues the job and runs it, as for any job of a dead worker."""
        store.hosts.live_owners.add(INCARNATION)
        old = lifecycle.start(new_job(), host=HOST, runner_id=RUNNER_ID, owner=f"{HOST}:0:1")
        job = store.jobs.add(old.model_copy(update={"direct": True}))
        prepared = tasks._prepare(store.as_store, job.id, RUNNER_ID, INCARNATION)
        assert isinstance(prepared, tasks.Prepared) and not prepared.handed_over
        assert (prepared.job.status, prepared.job.attempts) == (RS.QUEUED, 1)

    def test_a_queued_job_is_prepared_with_its_runner(self, store: FakeStore) -> None:
        job = store.jobs.add(new_job())
        assert tasks._prepare(store.as_store, job.id, RUNNER_ID, INCARNATION) == tasks.Prepared(
            job, store.runners.states[RUNNER_ID]
        )

    def test_redis_unreachable_rejects_the_message_with_requeue(self, store: FakeStore) -> None:
        job = store.jobs.add(new_job())
        store.link.unreachable = 1
        with pytest.raises(Reject) as rejected:
            tasks._prepare(store.as_store, job.id, RUNNER_ID, INCARNATION)
        assert rejected.value.args[1] is True


class TestHandOver:
    def hand_over(self, store: FakeStore, job: JobRecord) -> tasks.Attempt | None:
        task = FakeTask(store)
        prepared = tasks.Prepared(job, store.runners.get(RUNNER_ID))
        return tasks._hand_over(cast(Any, task), prepared, RUNNER_ID)

    def test_the_job_is_marked_running_here_and_put_in_the_runners_inbox(
        self, store: FakeStore, clock: FakeClock
    ) -> None:
        job = store.jobs.add(new_job())
        attempt = self.hand_over(store, job)
        assert attempt == tasks.Attempt(store.runners.states[RUNNER_ID], "0-0", 0)
        running = store.jobs.records[job.id]
        assert (running.status, running.owner, running.host) == (RS.RUNNING, INCARNATION, HOST)
        [command] = store.runners.inboxes[RUNNER_ID]
        assert isinstance(command, SubmitJob) and command.job == running
        assert clock.now < command.soft_deadline < command.deadline

    def test_a_later_attempt_starts_after_the_last_ending(self, store: FakeStore) -> None:
        job = store.jobs.add(running_elsewhere("other:1:1"))
        requeued = store.jobs.requeue(job.id)
        assert requeued is not None
        store.streams.events[job.id] = 5
        attempt = self.hand_over(store, requeued)
        assert attempt is not None and (attempt.after, attempt.events_before) == ("1-0", 5)

    def test_a_job_cancelled_meanwhile_is_not_handed_over(self, store: FakeStore) -> None:
        job = new_job()
        store.jobs.add(job.model_copy(update={"status": RS.CANCELLED}))
        assert self.hand_over(store, job) is None
        assert store.runners.inboxes[RUNNER_ID] == []

    def test_redis_failing_over_at_the_hand_over_is_waited_out(
        self, store: FakeStore, clock: FakeClock
    ) -> None:
        # A master killed under the hand-over: its task failed and the job waited ~18 s for
        # the recovery loop to send it again (tests/test_ha.py, 1 run of 4).
        job = store.jobs.add(new_job())
        prepared = tasks.Prepared(job, store.runners.get(RUNNER_ID))
        store.link.unreachable = 2
        started = clock.now
        assert tasks._hand_over(cast(Any, FakeTask(store)), prepared, RUNNER_ID) is not None
        assert clock.now - started == 2 * tasks.REDIS_RETRY_S
        assert store.jobs.records[job.id].status == RS.RUNNING
        assert len(store.runners.inboxes[RUNNER_ID]) == 1

    def test_a_hand_over_whose_answer_was_lost_is_not_made_twice(self, store: FakeStore) -> None:
        job = store.jobs.add(new_job())
        landed = store.runners.hand_over
        lost = [True]

        def answer_lost(runner_id: str, command: SubmitJob) -> bool:
            handed = landed(runner_id, command)
            if lost.pop() if lost else False:
                raise redis.ConnectionError("the master died before it answered (fake)")
            return handed

        store.runners.hand_over = answer_lost  # type: ignore[method-assign]
        assert self.hand_over(store, job) is not None
        assert len(store.runners.inboxes[RUNNER_ID]) == 1

    def test_a_loading_runner_is_waited_for(self, store: FakeStore, clock: FakeClock) -> None:
        loading = runner(RunnerStatus.LOADING)  # as read with the job; ready at the next look
        started = clock.now
        state = tasks._await_runner(store.as_store, RUNNER_ID, loading, 300.0, pinned=None)
        assert state.status == RunnerStatus.READY and clock.now - started == pytest.approx(0.1)

    def test_an_unloaded_runner_is_asked_once_to_load(self, store: FakeStore) -> None:
        store.runners.states[RUNNER_ID] = runner(RunnerStatus.UNLOADED)
        asked: list[Any] = []
        store.hosts.on_supervisor = asked.append
        with pytest.raises(RunnerGone):  # it never loads, here
            tasks._await_runner(
                store.as_store, RUNNER_ID, store.runners.states[RUNNER_ID], 300.0, pinned=None
            )
        assert asked == [StartRunnerRequest(runner_id=RUNNER_ID)]

    def test_a_runner_never_ready_is_runner_gone_after_the_start_timeout(
        self, store: FakeStore, clock: FakeClock
    ) -> None:
        store.runners.states[RUNNER_ID] = runner(RunnerStatus.LOADING)
        started = clock.now
        with pytest.raises(RunnerGone, match="not ready after 300s"):
            tasks._await_runner(
                store.as_store, RUNNER_ID, store.runners.states[RUNNER_ID], 300.0, pinned=None
            )
        assert 300.0 < clock.now - started < 300.5

    def test_a_runner_failed_for_good_is_the_jobs_failure(self, store: FakeStore) -> None:
        store.runners.states[RUNNER_ID] = runner(RunnerStatus.FAILED, error="model failed to load")
        with pytest.raises(RunnerGone, match="model failed to load"):
            self.hand_over(store, store.jobs.add(new_job()))

    def test_a_failed_runner_with_a_restart_coming_is_waited_for(self, store: FakeStore) -> None:
        state = runner(RunnerStatus.FAILED, next_restart_at=utcnow())
        store.runners.states[RUNNER_ID] = runner(RunnerStatus.READY)
        ready = tasks._await_runner(store.as_store, RUNNER_ID, state, 300.0, pinned=None)
        assert ready.status == RunnerStatus.READY

    def test_a_runner_shut_down_on_purpose_rejects_with_requeue(self, store: FakeStore) -> None:
        store.runners.states[RUNNER_ID] = runner(RunnerStatus.SHUTDOWN)
        with pytest.raises(Reject) as rejected:
            self.hand_over(store, store.jobs.add(new_job()))
        assert rejected.value.args[1] is True

    def test_a_job_pinned_here_waits_before_its_requeue(
        self, store: FakeStore, clock: FakeClock
    ) -> None:
        store.runners.states[RUNNER_ID] = runner(RunnerStatus.SHUTDOWN)
        started = clock.now
        with pytest.raises(Reject):
            tasks._refuse_if_stopped(RUNNER_ID, store.runners.states[RUNNER_ID], pinned=HOST)
        assert clock.now - started == tasks.PINNED_REQUEUE_PAUSE_S


class TestFollow:
    def follow(self, store: FakeStore, job: JobRecord, after: str = "0-0", **kw: Any) -> JobEnding:
        return tasks._follow(store.as_store, job.id, store.runners.states[RUNNER_ID], after, **kw)

    def started(self, store: FakeStore) -> JobRecord:
        return store.jobs.add(new_job(status=RS.RUNNING, owner=INCARNATION, runner_id=RUNNER_ID))

    def test_returns_the_record_of_the_attempts_ending(self, store: FakeStore) -> None:
        job = self.started(store)
        store.jobs.end(job.id, RS.SUCCEEDED, finish_reason="stop")
        assert self.follow(store, job).status == RS.SUCCEEDED

    def test_an_ending_before_the_attempt_began_does_not_count(self, store: FakeStore) -> None:
        job = self.started(store)
        store.jobs.requeue(job.id)  # ending "1-0": the last attempt's
        store.jobs.records[job.id] = store.jobs.records[job.id].model_copy(
            update={"status": RS.RUNNING}
        )
        store.jobs.end(job.id, RS.SUCCEEDED, finish_reason="stop")
        assert self.follow(store, job, after="1-0").status == RS.SUCCEEDED

    def test_an_attempt_its_runner_requeued_rejects_the_message_with_requeue(
        self, store: FakeStore
    ) -> None:
        job = self.started(store)
        store.jobs.requeue(job.id)
        with pytest.raises(Reject) as rejected:
            self.follow(store, job)
        assert rejected.value.args[1] is True

    @pytest.mark.parametrize(
        "now",
        [None, runner(pid=1), runner(RunnerStatus.FAILED), runner(RunnerStatus.SHUTDOWN)],
        ids=["gone", "another-process", "failed", "shut-down"],
    )
    def test_a_runner_that_died_silently_fails_the_job(
        self, store: FakeStore, now: Any, clock: FakeClock
    ) -> None:
        job = self.started(store)
        followed = store.runners.states[RUNNER_ID]
        if now is None:
            del store.runners.states[RUNNER_ID]
        else:
            store.runners.states[RUNNER_ID] = now
        started = clock.now
        final = tasks._follow(store.as_store, job.id, followed, "0-0")
        assert final.status == RS.FAILED and "stopped while running the job" in (final.error or "")
        # Noticed after one slice of waiting, not at the job's time limit.
        assert clock.now - started == tasks.WAIT_SLICE_MS / 1000

    def test_between_waits_the_progress_report_gets_the_jobs_events(self, store: FakeStore) -> None:
        job = self.started(store)
        store.streams.events[job.id] = 7
        seen: list[int] = []

        class Progress:
            def update(self, events: int) -> None:
                seen.append(events)
                store.jobs.end(job.id, RS.SUCCEEDED, finish_reason="stop")

        self.follow(store, job, progress=cast(Any, Progress()))
        assert seen == [7]

    def test_redis_restarting_is_waited_out(self, store: FakeStore, clock: FakeClock) -> None:
        job = self.started(store)
        store.jobs.end(job.id, RS.SUCCEEDED, finish_reason="stop")
        store.link.unreachable = 2
        started = clock.now
        assert self.follow(store, job).status == RS.SUCCEEDED
        assert clock.now - started == 2 * tasks.REDIS_RETRY_S

    def test_past_until_the_task_times_the_job_out_itself(self, store: FakeStore) -> None:
        job = self.started(store)
        final = self.follow(store, job, until=store.clock.now + 2.5)
        assert (final.status, final.output.finish_reason) == (RS.TIMED_OUT, "time_limit")


class TestSoftLimit:
    def test_a_job_not_handed_over_yet_times_out_without_running(self, store: FakeStore) -> None:
        job = store.jobs.add(new_job())
        final = tasks._after_soft_limit(store.as_store, job.id, None)
        assert final is not None and final.status == RS.TIMED_OUT
        assert store.runners.inboxes[RUNNER_ID] == []

    def test_a_handed_over_job_is_cancelled_at_its_runner_and_followed(
        self, store: FakeStore
    ) -> None:
        ends_jobs_it_is_told_to_cancel(store)
        job = store.jobs.add(new_job(status=RS.RUNNING, runner_id=RUNNER_ID))
        attempt = tasks.Attempt(store.runners.states[RUNNER_ID], "0-0", 0)
        final = tasks._after_soft_limit(store.as_store, job.id, attempt)
        assert store.runners.inboxes[RUNNER_ID] == [CancelJob(job_id=job.id, reason="time_limit")]
        assert final is not None and final.status == RS.TIMED_OUT

    def test_a_runner_that_does_not_answer_is_waited_for_cancel_ack_s_only(
        self, store: FakeStore, clock: FakeClock
    ) -> None:
        job = store.jobs.add(new_job(status=RS.RUNNING, runner_id=RUNNER_ID))
        attempt = tasks.Attempt(store.runners.states[RUNNER_ID], "0-0", 0)
        started = clock.now
        final = tasks._after_soft_limit(store.as_store, job.id, attempt)
        assert final is not None and final.status == RS.TIMED_OUT
        assert tasks.CANCEL_ACK_S <= clock.now - started <= tasks.CANCEL_ACK_S + 1.0

    def test_the_limit_in_the_wait_ends_the_task_as_its_job_timed_out(
        self, store: FakeStore
    ) -> None:
        ends_jobs_it_is_told_to_cancel(store)
        job = store.jobs.add(new_job())
        store.streams.interrupt = SoftTimeLimitExceeded()
        with pytest.raises(JobEnded, match="timed_out"):
            inference(FakeTask(store), job.id, "tiny")
        assert store.connections_dropped == 1  # the limit may have cut a reply in half
        assert store.runners.inboxes[RUNNER_ID][-1] == CancelJob(job_id=job.id, reason="time_limit")

    @pytest.mark.parametrize(
        "exception", [SoftTimeLimitExceeded(), DecodeError(SoftTimeLimitExceeded())]
    )
    def test_a_limit_that_cut_the_task_before_its_body_times_the_job_out(
        self, store: FakeStore, exception: BaseException
    ) -> None:
        job = store.jobs.add(new_job())
        sender = cast(Any, FakeTask(store))
        tasks._time_out_a_task_cut_before_its_body(sender, job.id, exception)
        assert store.jobs.records[job.id].status == RS.TIMED_OUT

    def test_other_failures_before_the_body_leave_the_job_alone(self, store: FakeStore) -> None:
        job = store.jobs.add(new_job())
        sender = cast(Any, FakeTask(store))
        tasks._time_out_a_task_cut_before_its_body(sender, job.id, ValueError("x"))
        sender.name = "exo.load_runner"
        tasks._time_out_a_task_cut_before_its_body(sender, job.id, SoftTimeLimitExceeded())
        assert store.jobs.records[job.id].status == RS.QUEUED


class TestHardLimit:
    def test_the_job_fails_and_its_runner_drops_it(self, store: FakeStore) -> None:
        job = store.jobs.add(new_job(status=RS.RUNNING, runner_id=RUNNER_ID))
        task = cast(Any, FakeTask(store))
        tasks.InferenceTask.on_failure(task, TimeLimitExceeded(60), job.id, (), {}, cast(Any, None))
        assert store.jobs.records[job.id].status == RS.FAILED
        assert store.jobs.records[job.id].error == "hard time limit exceeded (60s)"
        assert store.runners.inboxes[RUNNER_ID] == [CancelJob(job_id=job.id)]

    def test_other_failures_are_celerys_alone(self, store: FakeStore) -> None:
        job = store.jobs.add(new_job(status=RS.RUNNING, runner_id=RUNNER_ID))
        task = cast(Any, FakeTask(store))
        tasks.InferenceTask.on_failure(task, ValueError("x"), job.id, (), {}, cast(Any, None))
        assert (
            store.jobs.records[job.id].status == RS.RUNNING
            and store.runners.inboxes[RUNNER_ID] == []
        )


class TestRejectRequeue:
    """What goes back to the queue (Reject with requeue), and where."""

    @pytest.fixture
    def resent(self, monkeypatch: pytest.MonkeyPatch) -> list[JobRecord]:
        sent: list[JobRecord] = []
        monkeypatch.setattr(jobs, "resend", lambda store, celery, settings, job: sent.append(job))
        return sent

    def run(self, store: FakeStore, job: JobRecord, queue: str) -> dict[str, Any]:
        task = FakeTask(store)
        task.request.delivery_info = {"routing_key": queue}
        result: dict[str, Any] = inference(task, job.id, "tiny")
        return result

    def test_a_job_sent_here_by_its_prefix_goes_to_its_models_queue(
        self, store: FakeStore, resent: list[JobRecord]
    ) -> None:
        store.runners.states[RUNNER_ID] = runner(RunnerStatus.SHUTDOWN)
        job = store.jobs.add(new_job())
        with pytest.raises(Reject) as rejected:
            self.run(store, job, host_queue(HOST))
        assert rejected.value.args[1] is False
        assert [j.id for j in resent] == [job.id]

    @pytest.mark.parametrize("pinned", [True, False], ids=["pinned-here", "models-queue"])
    def test_a_job_from_its_models_queue_or_pinned_here_is_requeued_where_it_was(
        self, store: FakeStore, resent: list[JobRecord], pinned: bool
    ) -> None:
        store.runners.states[RUNNER_ID] = runner(RunnerStatus.SHUTDOWN)
        job = new_job()
        if pinned:
            job.request.host = HOST
        store.jobs.add(job)
        queue = host_queue(HOST) if pinned else model_queue("tiny")
        with pytest.raises(Reject) as rejected:
            self.run(store, job, queue)
        assert rejected.value.args[1] is True and resent == []

    def test_a_job_error_fails_the_job_and_the_task(self, store: FakeStore) -> None:
        store.runners.states[RUNNER_ID] = runner(RunnerStatus.FAILED, error="bad weights")
        job = store.jobs.add(new_job())
        with pytest.raises(RunnerGone):
            self.run(store, job, model_queue("tiny"))
        assert store.jobs.records[job.id].status == RS.FAILED
        assert "bad weights" in (store.jobs.records[job.id].error or "")

    def test_a_job_that_runs_to_its_end_is_the_tasks_result(self, store: FakeStore) -> None:
        job = store.jobs.add(new_job())

        def run_it(runner_id: str, command: RunnerCommand) -> None:
            if isinstance(command, SubmitJob):
                store.jobs.end(command.job.id, RS.SUCCEEDED, finish_reason="stop")

        store.runners.on_send = run_it
        result = self.run(store, job, model_queue("tiny"))
        assert result == {
            "job_id": job.id,
            "status": RS.SUCCEEDED,
            "finish_reason": "stop",
            "tokens": 0,
            "runner": RUNNER_ID,
        }
