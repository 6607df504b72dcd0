"""Which runner takes a job as it is submitted (exo_tasks.direct.pick), and when a short job's
task is due: pure, on a fleet built here. The hand-over itself, its room check in Redis and what
a worker does with such a job are tests/test_direct.py's."""

from __future__ import annotations

import time

from exo_tasks import direct
from exo_tasks.fleet import Fleet
from exo_tasks.fleet_types import HostState, RunnerState, RunnerStatus
from exo_tasks.store.runners import Room
from exo_tasks.types import JobRequest, utcnow
from tests.unit.fakes import settings


def fleet(*runners: tuple[str, int, RunnerStatus]) -> Fleet:
    """Hosts serving model `m`, each (name, its runner's active jobs, its runner's status)."""
    hosts = {
        name: HostState(
            name=name, pid=1, incarnation=f"{name}:1:1", models=["m"], started_at=utcnow()
        )
        for name, _, _ in runners
    }
    states = [
        RunnerState(id=f"m@{name}", host=name, model="m", status=status, active_jobs=active)
        for name, active, status in runners
    ]
    return Fleet(hosts=hosts, runners={r.id: r for r in states})


READY, RUNNING = RunnerStatus.READY, RunnerStatus.RUNNING


def test_the_runner_with_the_fewest_jobs_takes_the_job_held_by_its_hosts_worker() -> None:
    picked = direct.pick(fleet(("a", 3, RUNNING), ("b", 1, RUNNING)), settings(), "m", None)
    assert picked is not None
    assert (picked.runner_id, picked.host, picked.owner) == ("m@b", "b", "b:1:1")


def test_a_job_for_one_host_goes_to_that_hosts_runner_only() -> None:
    both = fleet(("a", 3, RUNNING), ("b", 1, RUNNING))
    picked = direct.pick(both, settings(), "m", "a")
    assert picked is not None and (picked.runner_id, picked.owner) == ("m@a", "a:1:1")


def test_the_room_checked_again_is_a_full_batch_and_the_hosts_pool_children() -> None:
    """The hand-over's script counts the jobs in Redis (the fleet may be a moment old): the
    runner's against a full batch, its host's runners' together against its pool children."""
    two_models = fleet(("a", 0, READY))
    two_models.hosts["a"] = two_models.hosts["a"].model_copy(update={"concurrency": 8})
    other = two_models.runners["m@a"].model_copy(update={"id": "n@a", "model": "n"})
    two_models.runners[other.id] = other
    picked = direct.pick(two_models, settings(), "m", None)
    assert picked is not None
    assert picked.room == Room(settings().completion_batch_size, 8, ("m@a", "n@a"))


def test_no_runner_with_room_leaves_the_job_to_celerys_queue() -> None:
    full = settings().completion_batch_size
    assert direct.pick(fleet(("a", full, RUNNING)), settings(), "m", None) is None
    assert direct.pick(fleet(("a", 0, RunnerStatus.LOADING)), settings(), "m", None) is None
    assert direct.pick(fleet(("a", 0, RunnerStatus.SHUTTING_DOWN)), settings(), "m", None) is None
    assert direct.pick(fleet(("a", 0, READY)), settings(), "other", None) is None


def test_a_host_whose_worker_names_no_incarnation_gets_no_direct_job() -> None:
    """No owner to hold the job: only a task of its own may hand it over there."""
    anonymous = fleet(("a", 0, READY))
    anonymous.hosts["a"] = anonymous.hosts["a"].model_copy(update={"incarnation": ""})
    assert direct.pick(anonymous, settings(), "m", None) is None


def test_the_setting_off_hands_every_job_to_its_task() -> None:
    off = settings(direct_hand_over=False)
    assert direct.pick(fleet(("a", 0, READY)), off, "m", None) is None


def test_a_short_jobs_task_is_due_after_the_delay_and_any_other_at_once() -> None:
    delay_ms = settings().direct_task_delay_ms
    short = JobRequest(prompt="p", max_tokens=direct.SHORT_JOB_TOKENS)
    before = time.time()
    due = direct.task_due(settings(), short)
    assert before + delay_ms / 1000 <= due <= time.time() + delay_ms / 1000
    longer = JobRequest(prompt="p", max_tokens=direct.SHORT_JOB_TOKENS + 1)
    assert direct.task_due(settings(), longer) == 0
    assert direct.task_due(settings(direct_task_delay_ms=0), short) == 0
