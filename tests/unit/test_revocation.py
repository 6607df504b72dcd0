"""Celery's revoke and terminate made a cancel for the tasks that run jobs
(exo_tasks.worker.revocation): a job's task is cancelled through the job service and never
signalled; any other task id goes to Celery's own handler as sent."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from exo_tasks.commands import CancelJob
from exo_tasks.types import JobStatus
from exo_tasks.worker import revocation
from tests.unit.fakes import INCARNATION, RUNNER_ID, FakeApp, FakeStore, new_job, settings

RS = JobStatus


class Dispatcher:
    """The worker's event dispatcher: the events it sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send(self, event: str, **fields: Any) -> None:
        self.sent.append((event, fields))


@dataclass
class Consumer:
    event_dispatcher: Dispatcher = field(default_factory=Dispatcher)


@dataclass
class State:
    """What Celery hands a control command: its app and the worker's consumer."""

    app: FakeApp
    consumer: Consumer = field(default_factory=Consumer)


@pytest.fixture
def store() -> FakeStore:
    return FakeStore()


@pytest.fixture
def celery_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Celery's own revoke, as our handler calls it."""
    calls: list[tuple[Any, ...]] = []

    def celery_revoke(state: Any, task_ids: list[str], *args: Any, **kwargs: Any) -> dict[str, Any]:
        calls.append((task_ids, *args))
        return {"ok": "celery"}

    monkeypatch.setattr(revocation, "celery_revoke", celery_revoke)
    return calls


def state_of(store: FakeStore) -> Any:
    return State(FakeApp(store, settings()))


class TestRevoke:
    def test_a_queued_jobs_task_is_cancelled_and_only_flagged_for_celery(
        self, store: FakeStore, celery_calls: list[tuple[Any, ...]]
    ) -> None:
        job = store.jobs.add(new_job())
        reply = revocation.revoke(state_of(store), job.id, terminate=True, signal="KILL")
        assert store.jobs.records[job.id].status == RS.CANCELLED
        assert celery_calls == [([job.id],)]  # no terminate, no signal
        assert reply == {"ok": f"jobs {job.id} cancelled"}

    def test_a_queued_jobs_message_is_withdrawn_and_its_task_revoked_by_one_worker(
        self, store: FakeStore, celery_calls: list[tuple[Any, ...]]
    ) -> None:
        job = store.jobs.add(new_job())
        store.jobs.waiting_messages.add(job.id)
        first, second = state_of(store), state_of(store)  # two workers get the revoke
        revocation.revoke(first, job.id)
        revocation.revoke(second, job.id)  # the job is cancelled already: a 409, no signal
        assert store.jobs.waiting_messages == set()
        [(event, fields)] = first.consumer.event_dispatcher.sent
        reason = "revoked in Flower (or by celery control revoke)"
        ended = {
            "tokens": 0,
            "max_tokens": job.request.max_tokens,
            "runner": None,
            "reason": reason,
        }
        assert (event, fields["uuid"], fields["result"]) == ("task-revoked", job.id, repr(ended))
        assert first.app.backend.revoked == [job.id]
        assert second.consumer.event_dispatcher.sent == [] and second.app.backend.revoked == []

    def test_a_message_a_worker_took_already_is_left_to_that_worker(
        self, store: FakeStore, celery_calls: list[tuple[Any, ...]]
    ) -> None:
        job = store.jobs.add(new_job())  # its message is in no queue
        state = state_of(store)
        revocation.revoke(state, job.id)
        assert store.jobs.records[job.id].status == RS.CANCELLED
        assert state.consumer.event_dispatcher.sent == [] and state.app.backend.revoked == []

    def test_a_running_job_is_cancelled_at_its_runner_and_its_pool_child_spared(
        self, store: FakeStore, celery_calls: list[tuple[Any, ...]]
    ) -> None:
        job = store.jobs.add(new_job(status=RS.RUNNING, owner=INCARNATION, runner_id=RUNNER_ID))
        revocation.terminate(state_of(store), "SIGKILL", [job.id])
        assert store.runners.inboxes[RUNNER_ID] == [CancelJob(job_id=job.id, reason="cancelled")]
        assert celery_calls == [([job.id],)]

    def test_an_ended_job_is_not_signalled_either(
        self, store: FakeStore, celery_calls: list[tuple[Any, ...]]
    ) -> None:
        job = store.jobs.add(new_job(status=RS.SUCCEEDED))
        revocation.revoke(state_of(store), job.id, terminate=True, signal="TERM")
        assert celery_calls == [([job.id],)] and store.jobs.records[job.id].status == RS.SUCCEEDED

    def test_in_doubt_redis_down_a_job_is_never_signalled(
        self, store: FakeStore, celery_calls: list[tuple[Any, ...]]
    ) -> None:
        job = store.jobs.add(new_job())
        store.link.unreachable = 1
        revocation.revoke(state_of(store), job.id, terminate=True, signal="KILL")
        assert celery_calls == [([job.id],)]

    def test_an_id_that_names_no_job_goes_to_celery_as_sent(
        self, store: FakeStore, celery_calls: list[tuple[Any, ...]]
    ) -> None:
        job = store.jobs.add(new_job())
        reply = revocation.revoke(
            state_of(store), [job.id, "not-a-job"], terminate=True, signal="KILL"
        )
        assert celery_calls == [([job.id],), (["not-a-job"], True, "KILL")]
        assert reply == {"ok": "celery"}
