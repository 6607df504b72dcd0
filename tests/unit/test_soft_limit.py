"""A soft time limit that arrives once the task's outcome is decided changes nothing
(exo_tasks.worker.soft_limit). Through Celery's own tracer, the limit's signal is sent to the
test's process while the tracer stores the task's outcome, where a timed-out job's JobEnded
was replaced by SoftTimeLimitExceeded() when the worker's main process signalled a moment
after the runner had ended the job at the same deadline; then for the task's other outcomes,
a failure and a requeue."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any, cast

import pytest
from celery import Celery, Task, states
from celery.app.trace import build_tracer
from celery.backends.cache import CacheBackend
from celery.exceptions import Reject, SoftTimeLimitExceeded

from exo_tasks.errors import RunnerGone
from exo_tasks.fleet_types import RunnerStatus
from exo_tasks.types import JobRecord, JobStatus
from exo_tasks.worker import soft_limit, task_states, tasks
from exo_tasks.worker.task_states import JobEnded
from tests.unit.fakes import RUNNER_ID, FakeStore, FakeTask, clock_of, new_job, runner

SOFT_S = 1.0


class LimitWhileStoring(CacheBackend):
    """The memory cache backend; the soft limit's signal arrives during its first write, as it
    did during the Redis write of the task's outcome."""

    signalled = False

    def store_result(self, *args: Any, **kwargs: Any) -> Any:
        if not self.signalled:
            self.signalled = True
            limit_now()
        return super().store_result(*args, **kwargs)


@pytest.fixture(autouse=True)
def sigusr1() -> Iterator[None]:
    """The handler the tasks install, taken back after the test."""
    previous = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, previous)


@pytest.fixture
def app() -> Celery:
    return Celery("unit", broker="memory://", backend="cache+memory://", set_as_current=False)


def trace(
    app: Celery, task: Task[Any, Any], *, limit_while_storing: bool = True
) -> tuple[Any, dict[str, Any]]:
    """Run `task` as a pool child does: its outcome as the child hands it to the worker's main
    process (a result, or an ExceptionInfo for the `task-failed` event Flower shows), and what
    the backend stored (what AsyncResult reads)."""
    backend = LimitWhileStoring(app=app, backend="memory")
    backend.signalled = not limit_while_storing
    task.backend = backend
    task_id = uuid.uuid4().hex
    run = build_tracer(task.name, task, app=app, hostname="unit@host")
    outcome, *_ = run(task_id, [], {}, {"id": task_id, "timelimit": (None, SOFT_S)})
    stored: dict[str, Any] = backend.get_task_meta(task_id)
    return outcome, stored


def ending_task(app: Celery, job: JobRecord) -> Task[Any, Any]:
    @app.task(bind=True, name=f"ends-{job.status}", shared=False)
    def ends(self: Task[Any, Any]) -> dict[str, Any]:
        return task_states.finish(self, job.id, job)

    return ends


def test_a_limit_while_the_failure_is_stored_leaves_the_jobs_reason(app: Celery) -> None:
    job = new_job(status=JobStatus.TIMED_OUT, runner_id=RUNNER_ID)
    job.output.finish_reason = "time_limit"
    outcome, stored = trace(app, ending_task(app, job))
    for exception in (outcome.exception, stored["result"]):
        assert isinstance(exception, JobEnded), exception
        assert "its soft time limit of 1s was reached" in str(exception)
    assert stored["status"] == states.FAILURE


def test_a_limit_while_the_success_is_stored_leaves_it_a_success(app: Celery) -> None:
    job = new_job(status=JobStatus.SUCCEEDED, runner_id=RUNNER_ID)
    outcome, stored = trace(app, ending_task(app, job))
    assert outcome["status"] == JobStatus.SUCCEEDED
    assert stored["status"] == states.SUCCESS and stored["result"] == outcome


def test_the_next_task_is_limited_again(app: Celery) -> None:
    trace(app, ending_task(app, new_job(status=JobStatus.SUCCEEDED)))

    @app.task(name="limited", shared=False)
    def limited() -> str:
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
        except SoftTimeLimitExceeded:
            return "limited"
        return "not limited"

    assert trace(app, limited, limit_while_storing=False)[0] == "limited"


def limit_now() -> None:
    os.kill(os.getpid(), signal.SIGUSR1)  # its handler runs before the next line


@pytest.mark.parametrize(
    ("status", "outcome"),
    [(RunnerStatus.FAILED, RunnerGone), (RunnerStatus.SHUTDOWN, Reject)],
    ids=["failed", "requeued"],
)
def test_a_limit_after_the_task_failed_or_requeued_its_job_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, status: RunnerStatus, outcome: type[Exception]
) -> None:
    store = FakeStore(clock_of(monkeypatch, tasks))
    store.runners.states[RUNNER_ID] = runner(status, error="bad weights")
    job = store.jobs.add(new_job())
    soft_limit.arm()
    with pytest.raises(outcome):
        cast(Any, tasks.inference).__wrapped__.__func__(FakeTask(store), job.id, "tiny")
    limit_now()  # as while Celery stores the failure or requeues the message
    soft_limit.arm()  # the next task's
    with pytest.raises(SoftTimeLimitExceeded):
        limit_now()
