"""The runner's loop logic without a process, a model or Redis: stop requests merging, jobs
expiring by the runner's own clock, and a burst of jobs gathered before the next step."""

from __future__ import annotations

import time
import uuid
from typing import Any, cast

import pytest

from exo_tasks import runner as runner_module
from exo_tasks.commands import StopRunner, SubmitJob
from exo_tasks.runner import Runner, RunnerProgress, RunnerSpec
from exo_tasks.store import Store
from exo_tasks.types import JobRecord, JobRequest, JobStatus, RunnerStatus, SamplingParams


class FakeStore:
    """What the loop writes, kept in memory."""

    def __init__(self) -> None:
        self.published: list[RunnerStatus] = []

    def publish_runner(self, state: Any, *, status_changed: bool = True) -> None:
        self.published.append(state.status)


class FakeEngine:
    largest_batch = 0

    def __init__(self) -> None:
        self.jobs: list[str] = []

    def encode(self, prompt: str | None, messages: Any, tools: Any = None) -> list[int]:
        return [1, 2, 3]

    def add(self, job_id: str, prompt_tokens: list[int], params: SamplingParams) -> None:
        self.jobs.append(job_id)

    def remove(self, job_id: str) -> None:
        self.jobs.remove(job_id)


@pytest.fixture
def runner() -> Runner:
    spec = RunnerSpec(
        runner_id="tiny@unit",
        host="unit",
        model="tiny",
        model_path="unused",
        redis_url="redis://127.0.0.1:1/0",
        job_ttl_s=60,
        max_prompt_tokens=100,
        prefill_batch_size=3,
    )
    unit = Runner(spec, RunnerProgress([0.0, 0.0, 0.0]), cast(Store, FakeStore()))
    unit.engine = FakeEngine()  # type: ignore[assignment]  # no model: load() is not run
    return unit


def store_of(runner: Runner) -> FakeStore:
    return cast(FakeStore, runner.store)


def submit(soft_in_s: float = 30.0, hard_in_s: float = 60.0) -> SubmitJob:
    request = JobRequest.model_validate({"prompt": "hi", "max_tokens": 4})
    job = JobRecord(id=uuid.uuid4().hex, model="tiny", request=request, status=JobStatus.RUNNING)
    now = time.time()
    return SubmitJob(job=job, soft_deadline=now + soft_in_s, deadline=now + hard_in_s)


def test_a_stop_under_way_only_gets_stricter(runner: Runner) -> None:
    runner._begin_stop(StopRunner(mode="warm", timeout_s=30, requeue=True))
    first_deadline = runner.stop_deadline
    assert store_of(runner).published == [RunnerStatus.SHUTTING_DOWN]

    runner._begin_stop(StopRunner(mode="warm", timeout_s=30, requeue=True))
    assert len(store_of(runner).published) == 1  # the same stop again: nothing published

    runner._begin_stop(StopRunner(mode="warm", timeout_s=300))  # later, not requeueing
    assert runner.stop_deadline == first_deadline
    assert runner.stop_request is not None and runner.stop_request.requeue

    runner._begin_stop(StopRunner(mode="hard"))
    assert runner.stop_deadline <= time.monotonic()
    assert runner.stop_request.mode == "hard" and runner.stop_request.requeue


def test_jobs_past_their_limits_end_by_the_runners_clock(runner: Runner) -> None:
    soft, hard, fresh = submit(soft_in_s=-1), submit(soft_in_s=-2, hard_in_s=-1), submit()
    for command in (soft, hard, fresh):
        runner._admit(command)
    assert len(runner.active) == 3

    runner._drop_expired()

    ended = {job.id: job for job in runner.unsent_endings}
    assert set(runner.active) == {fresh.job.id}
    assert ended[soft.job.id].status == JobStatus.TIMED_OUT
    assert ended[soft.job.id].output.finish_reason == "time_limit"
    assert ended[hard.job.id].status == JobStatus.FAILED
    assert ended[hard.job.id].error == "hard time limit exceeded"
    assert cast(FakeEngine, runner.engine).jobs == [fresh.job.id]


def test_a_burst_is_gathered_up_to_a_prefill_batch(
    runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner_module, "GATHER_MAX_S", 1.0)
    runner.step_s = 4.0  # a long step: the share of it allows the whole GATHER_MAX_S
    runner._admit(submit())  # the one decoding
    for _ in range(5):
        runner.commands.put(submit())
    runner._take_commands(0.0)  # takes every command waiting
    assert len(runner.active) == 6

    for _ in range(5):
        runner.commands.put(submit())
    started = time.monotonic()
    runner._gather_burst(decoding=6)
    # Commands already in the inbox are all taken at once, past the prefill batch size.
    assert len(runner.active) == 11 and time.monotonic() - started < 0.5


def test_a_lone_job_is_not_held_back(runner: Runner) -> None:
    runner.step_s = 4.0
    runner._admit(submit())
    started = time.monotonic()
    runner._gather_burst(decoding=1)  # nothing more comes: no wait beyond one gap
    assert time.monotonic() - started < runner_module.GATHER_GAP_S + 0.05
