"""How an inference task shows in Celery's backend and in Flower (exo_tasks.worker.task_states):
its end as its job's end, and its progress at most every PROGRESS_EVERY_S, as a best effort."""

from __future__ import annotations

from typing import Any, cast

import pytest
from celery import states
from celery.exceptions import Ignore

from exo_tasks import jobs
from exo_tasks.types import JobEnding, JobStatus
from exo_tasks.worker import task_states
from exo_tasks.worker.task_states import JobEnded, TaskProgress
from tests.unit.fakes import RUNNER_ID, FakeClock, FakeStore, FakeTask, clock_of, new_job

RS = JobStatus


@pytest.fixture
def task() -> FakeTask:
    return FakeTask(FakeStore())


def finish(task: FakeTask, job_id: str, job: Any, max_tokens: int | None = None) -> dict[str, Any]:
    return task_states.finish(cast(Any, task), job_id, job, max_tokens)


class TestFinish:
    def test_a_succeeded_job_is_the_tasks_result(self, task: FakeTask) -> None:
        job = new_job(status=RS.SUCCEEDED, runner_id=RUNNER_ID)
        job.output.finish_reason = "stop"
        job.usage.completion_tokens = 7
        assert finish(task, job.id, job) == {
            "job_id": job.id,
            "status": RS.SUCCEEDED,
            "finish_reason": "stop",
            "tokens": 7,
            "runner": RUNNER_ID,
        }

    def test_an_unknown_job_is_a_result_too(self, task: FakeTask) -> None:
        assert finish(task, "gone", None) == {"job_id": "gone", "status": "unknown"}

    def test_a_cancelled_job_makes_the_task_revoked_and_nothing_stored_over_it(
        self, task: FakeTask
    ) -> None:
        job = new_job(status=RS.CANCELLED)
        with pytest.raises(Ignore):
            finish(task, job.id, job)
        assert task.backend.revoked == [job.id]
        assert [event for event, _ in task.sent] == ["task-revoked"]

    def test_a_revoked_task_shows_its_final_tokens_and_who_cancelled_it(
        self, task: FakeTask
    ) -> None:
        job = new_job(status=RS.CANCELLED, runner_id=RUNNER_ID)
        job.usage.completion_tokens = 134
        task.app.store.jobs.request_cancel(job.id, jobs.CancelledBy.REVOKE)
        task.app.store.jobs.request_cancel(job.id, jobs.CancelledBy.API)  # the first one counts
        with pytest.raises(Ignore):
            ending = JobEnding.model_validate(job.model_dump(exclude={"request"}))
            finish(task, job.id, ending, max_tokens=40)  # an ending has no request
        [(_, fields)] = task.sent
        reason = "revoked in Flower (or by celery control revoke)"
        ended = {"tokens": 134, "max_tokens": 40, "runner": RUNNER_ID, "reason": reason}
        assert fields["result"] == repr(ended)
        assert task.backend.reasons == [f"{reason} (134 tokens)"]

    def test_a_cancelled_job_is_revoked_even_when_the_backend_is_down(self, task: FakeTask) -> None:
        task.backend.fails = True
        job = new_job(status=RS.CANCELLED)
        with pytest.raises(Ignore):
            finish(task, job.id, job)
        assert [event for event, _ in task.sent] == ["task-revoked"]

    @pytest.mark.parametrize("status", [RS.FAILED, RS.TIMED_OUT])
    def test_a_failed_or_timed_out_job_is_the_tasks_failure_naming_why(
        self, task: FakeTask, status: JobStatus
    ) -> None:
        job = new_job(status=status, error="runner gone")
        with pytest.raises(JobEnded, match=f"job {status}: runner gone"):
            finish(task, job.id, job)

    @pytest.mark.parametrize(
        ("status", "limit"),
        [(RS.TIMED_OUT, "soft time limit of 1.5s"), (RS.FAILED, "hard time limit of 31.5s")],
    )
    def test_a_time_limit_is_named_with_its_seconds_and_nothing_chained(
        self, task: FakeTask, status: JobStatus, limit: str
    ) -> None:
        task.request.timelimit = (31.5, 1.5)  # Celery's (hard, soft)
        job = new_job(status=status, runner_id=RUNNER_ID)
        job.output.finish_reason = "time_limit"
        try:
            raise TimeoutError("the Redis read the soft limit cut")
        except TimeoutError:
            with pytest.raises(
                JobEnded, match=f"job {status} on runner {RUNNER_ID}: its {limit} was reached"
            ) as ended:
                finish(task, job.id, job)
        assert ended.value.__suppress_context__ and ended.value.__cause__ is None

    @pytest.mark.parametrize("status", [RS.QUEUED, RS.RUNNING])
    def test_a_job_still_active_leaves_the_tasks_state_to_its_attempt(
        self, task: FakeTask, status: JobStatus
    ) -> None:
        with pytest.raises(Ignore):
            finish(task, "j", new_job(status=status))
        assert task.backend.revoked == [] and task.sent == []


class TestTaskProgress:
    @pytest.fixture
    def clock(self, monkeypatch: pytest.MonkeyPatch) -> FakeClock:
        return clock_of(monkeypatch, task_states)

    def test_started_is_stored_at_the_first_check_not_at_the_hand_over(
        self, task: FakeTask, clock: FakeClock
    ) -> None:
        """A job that ends within its task's first wait slice writes no `STARTED` at all."""
        progress = TaskProgress(cast(Any, task), max_tokens=16, events_before=0, runner=RUNNER_ID)
        assert task.states == [] and task.sent == []
        clock.sleep(1.0)
        progress.update(events=0)
        meta = {"tokens": 0, "max_tokens": 16, "runner": RUNNER_ID}
        assert task.states == [(states.STARTED, meta)]
        [(event, fields)] = task.sent
        assert event == "task-started" and fields["result"] == repr(meta)

    def test_tokens_are_reported_at_most_every_progress_every_s(
        self, task: FakeTask, clock: FakeClock
    ) -> None:
        progress = TaskProgress(cast(Any, task), max_tokens=16, events_before=3, runner=RUNNER_ID)
        progress.update(events=3)
        clock.sleep(task_states.PROGRESS_EVERY_S - 0.1)
        progress.update(events=5)
        assert len(task.states) == 1  # too soon
        clock.sleep(0.1)
        progress.update(events=5)
        # The tokens of this attempt only: the events before it are an earlier attempt's.
        meta = {"tokens": 2, "max_tokens": 16, "runner": RUNNER_ID}
        assert task.states[-1] == (states.STARTED, meta)
        assert [event for event, _ in task.sent] == ["task-started"] * 2
        assert task.sent[-1][1]["result"] == repr(meta)

    def test_no_report_without_new_tokens(self, task: FakeTask, clock: FakeClock) -> None:
        progress = TaskProgress(cast(Any, task), max_tokens=16, events_before=0, runner=RUNNER_ID)
        progress.update(events=0)
        clock.sleep(10)
        progress.update(events=0)
        assert len(task.states) == 1 and len(task.sent) == 1

    def test_a_report_redis_refuses_is_dropped_and_sends_no_event(
        self, task: FakeTask, clock: FakeClock
    ) -> None:
        progress = TaskProgress(cast(Any, task), max_tokens=16, events_before=0, runner=RUNNER_ID)
        task.store_fails = True
        clock.sleep(10)
        progress.update(events=4)  # does not raise: progress is a best effort
        assert task.sent == []
        task.store_fails = False
        progress.update(events=4)  # no report made it yet: the next check tries again
        assert task.states == [
            (states.STARTED, {"tokens": 4, "max_tokens": 16, "runner": RUNNER_ID})
        ]
