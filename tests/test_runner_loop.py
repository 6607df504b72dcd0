"""The runner's loop logic without a process, a model or Redis: stop requests merging, jobs
expiring by the runner's own clock, and a burst of jobs gathered before the next step."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, cast

import pytest

from exo_tasks import prefix_routing
from exo_tasks.commands import CancelJob, CheckJobs, JobCheck, StopRunner, SubmitJob
from exo_tasks.fleet_types import RunnerStatus
from exo_tasks.runner import intake
from exo_tasks.runner import loop as runner_module
from exo_tasks.runner.lane import EngineFinish, TokenDelta
from exo_tasks.runner.loop import Runner
from exo_tasks.runner.process import EXIT_TERMINATED, RunnerProgress, RunnerSpec
from exo_tasks.store import Store
from exo_tasks.store.hosts import PrefixHint
from exo_tasks.types import JobRecord, JobRequest, JobStatus, SamplingParams
from tests.support.processes import wait_until
from tests.unit.fakes import RunnerWrites


class FakeEngine:
    """An engine that generates one token "x" per step for each job, up to its max_tokens."""

    lanes = 1
    prefill_chunks = 0
    tool_calling = False
    prompt_cache_bytes = 0
    weights_bytes = 0
    memory = (0, 0)
    prompt_tokenizer = None

    def __init__(self) -> None:
        self.jobs: dict[str, int] = {}  # job id -> its max_tokens
        self.sampled: dict[str, int] = {}
        self.largest_batch = 0
        self.warm = False
        self.closed = False

    def encode(self, prompt: str | None, messages: Any, tools: Any = None) -> list[int]:
        return [1, 2, 3]

    def add(self, job_id: str, prompt_tokens: list[int], params: SamplingParams) -> None:
        self.jobs[job_id], self.sampled[job_id] = params.max_tokens, 0

    def remove(self, job_id: str) -> None:
        del self.jobs[job_id]

    def step(self) -> list[TokenDelta]:
        self.largest_batch = max(self.largest_batch, len(self.jobs))
        deltas = []
        for job_id, max_tokens in list(self.jobs.items()):
            self.sampled[job_id] += 1
            done = self.sampled[job_id] == max_tokens
            if done:
                del self.jobs[job_id]
            finish: EngineFinish | None = "length" if done else None
            deltas.append(TokenDelta(job_id, "x", self.sampled[job_id], finish))
        return deltas

    def warmup(self) -> None:
        self.warm = True

    def close(self) -> None:
        self.closed = True


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
    store = cast(Store, RunnerWrites())
    unit = Runner(spec, RunnerProgress([0.0, 0.0, 0.0, 0.0]), store, lambda _: FakeEngine())
    # As Runner.run starts serving (the runner's status moves by exo_tasks.lifecycle's table).
    unit.outbox.publish(RunnerStatus.LOADING)
    unit.load()
    unit.outbox.publish(RunnerStatus.READY)
    return unit


def store_of(runner: Runner) -> RunnerWrites:
    return cast(RunnerWrites, runner.store)


def engine_of(runner: Runner) -> FakeEngine:
    return cast(FakeEngine, runner.in_flight.engine)


def submit(soft_in_s: float = 30.0, hard_in_s: float = 60.0) -> SubmitJob:
    request = JobRequest.model_validate({"prompt": "hi", "max_tokens": 4})
    job = JobRecord(id=uuid.uuid4().hex, model="tiny", request=request, status=JobStatus.RUNNING)
    now = time.time()
    return SubmitJob(job=job, soft_deadline=now + soft_in_s, deadline=now + hard_in_s)


def test_a_stop_under_way_only_gets_stricter(runner: Runner) -> None:
    runner._begin_stop(StopRunner(mode="warm", timeout_s=30, requeue=True))
    first_deadline = runner.stop_deadline
    published = store_of(runner).published
    assert published[-1].status == RunnerStatus.SHUTTING_DOWN
    count = len(published)

    runner._begin_stop(StopRunner(mode="warm", timeout_s=30, requeue=True))
    assert len(published) == count  # the same stop again: nothing published

    runner._begin_stop(StopRunner(mode="warm", timeout_s=300))  # later, not requeueing
    assert runner.stop_deadline == first_deadline
    assert runner.stop_request is not None and runner.stop_request.requeue

    runner._begin_stop(StopRunner(mode="hard"))
    assert runner.stop_deadline <= time.monotonic()
    assert runner.stop_request.mode == "hard" and runner.stop_request.requeue


def test_jobs_past_their_limits_end_by_the_runners_clock(runner: Runner) -> None:
    soft, hard, fresh = submit(soft_in_s=-1), submit(soft_in_s=-2, hard_in_s=-1), submit()
    for command in (soft, hard, fresh):
        runner.in_flight.admit(command)
    assert len(runner.in_flight.jobs) == 3

    runner.in_flight.drop_expired()

    ended = {job.id: job for job in runner.outbox.endings}
    assert set(runner.in_flight.jobs) == {fresh.job.id}
    assert ended[soft.job.id].status == JobStatus.TIMED_OUT
    assert ended[soft.job.id].output.finish_reason == "time_limit"
    assert ended[hard.job.id].status == JobStatus.FAILED
    assert ended[hard.job.id].error == "hard time limit exceeded"
    assert list(engine_of(runner).jobs) == [fresh.job.id]


def test_a_burst_is_gathered_up_to_a_prefill_batch(
    runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner_module, "GATHER_MAX_S", 1.0)
    runner.step_s = 4.0  # a long step: the share of it allows the whole GATHER_MAX_S
    runner.in_flight.admit(submit())  # the one decoding
    for _ in range(5):
        runner.commands.put(submit())
    runner._take_commands(0.0)  # takes every command waiting
    assert len(runner.in_flight.jobs) == 6

    for _ in range(5):
        runner.commands.put(submit())
    started = time.monotonic()
    runner._gather_burst(decoding=6)
    # Commands already in the inbox are all taken at once, past the prefill batch size.
    assert len(runner.in_flight.jobs) == 11 and time.monotonic() - started < 0.5


REFUSAL_S = 0.03


def test_a_flood_of_slow_refusals_is_taken_over_rounds_each_with_a_step(
    runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the loop took every command waiting before it stepped: 150 prompts of 100,000
    characters, 20-120 ms each to tokenize and refuse, held the batch for seconds."""
    decoding = submit()
    decoding.job.request.max_tokens = 100
    runner.in_flight.admit(decoding)

    def slow_encode(prompt: str | None, messages: Any, tools: Any = None) -> list[int]:
        time.sleep(REFUSAL_S)
        return [1] * 101  # over the cap of 100

    monkeypatch.setattr(engine_of(runner), "encode", slow_encode)
    for _ in range(30):
        runner.commands.put(submit())
    steps = store_of(runner).steps
    # Each refusal takes REFUSAL_S at least: a round takes as many as fit in the budget, and the
    # one under way when it ran out (counted, not timed: a loaded machine only makes them fewer).
    most = int(runner_module.COMMANDS_BUDGET_S / REFUSAL_S) + 1
    while not runner.commands.empty():
        runner._serve_once()
        runner.outbox.drain()  # the round's writes, in the store
        tokens, endings = steps[-1]
        assert [job_id for job_id, _ in tokens] == [decoding.job.id]  # the batch stepped
        assert 1 <= len(endings) <= most
    runner._flush()
    runner.outbox.drain()
    refused = [job for _, endings in steps for job in endings]
    assert len(refused) == 30 and all(job.status == JobStatus.FAILED for job in refused)
    assert refused[0].error == (
        "the prompt is 101 tokens after the chat template; at most 100 (EXO_MAX_PROMPT_TOKENS)"
    )


def test_a_refusal_is_progress_for_the_stall_watchdog(runner: Runner) -> None:
    runner.in_flight.admit(submit())
    runner.progress.array[0] = 0.0  # silent since the clock's start: stalled by any limit
    assert runner.progress.stall(60.0, 5.0) is not None
    runner._handle(intake.Refused(submit(), "prompt: is at least 9000 tokens"))
    assert runner.progress.stall(60.0, 5.0) is None
    assert runner.outbox.endings[-1].error == "prompt: is at least 9000 tokens"


def test_waiting_for_redis_is_progress_for_the_stall_watchdog(runner: Runner) -> None:
    """An outage longer than the decode timeout: the runner waits for Redis, and the
    supervisor must not take that for a hang (it would fail jobs that outlast the outage)."""
    runner.in_flight.admit(submit())
    store_of(runner).down = True
    runner.progress.array[0] = 0.0  # silent since the clock's start
    exits: list[object] = []

    def serve() -> None:
        try:
            runner.serve()
        except SystemExit as stop:
            exits.append(stop.code)

    serving = threading.Thread(target=serve, daemon=True)
    serving.start()
    try:
        wait_until(lambda: runner.progress.stall(60.0, 0.2) is None, 5, "a waiting runner's beat")
        time.sleep(3 * runner_module.REDIS_RETRY_S)
        assert runner.progress.stall(60.0, 2 * runner_module.REDIS_RETRY_S) is None
    finally:
        runner.terminate_requested = True  # with Redis down: it exits at its next wait
        serving.join(5)
    assert exits == [EXIT_TERMINATED]


def test_a_lone_job_is_not_held_back(runner: Runner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing more comes: the burst ends after one gap's wait, not the gathering's whole
    window (the waits asked for are counted, not timed: a loaded machine is slow to wake)."""
    waits: list[float] = []
    take_commands = runner._take_commands

    def counted(wait_s: float) -> bool:
        waits.append(wait_s)
        return take_commands(wait_s)

    monkeypatch.setattr(runner, "_take_commands", counted)
    runner.step_s = 4.0
    runner.in_flight.admit(submit())
    runner._gather_burst(decoding=1)
    assert len(waits) == 1 and waits[0] <= runner_module.GATHER_GAP_S


def test_the_runner_loads_its_engine_from_the_factory_and_frees_it(runner: Runner) -> None:
    engine = engine_of(runner)
    assert engine.warm
    assert [s.status for s in store_of(runner).published] == [
        RunnerStatus.LOADING,
        RunnerStatus.LOADED,
        RunnerStatus.WARMING_UP,
        RunnerStatus.READY,
    ]
    runner.unload()
    assert engine.closed and runner.in_flight.engine is None


def test_a_step_streams_tokens_and_ends_jobs_through_the_outbox(runner: Runner) -> None:
    short = submit()
    short.job.request.max_tokens = 1
    long = submit()
    runner.in_flight.admit(short)
    runner.in_flight.admit(long)

    runner._step()  # one token each; the short job is done
    runner.outbox.drain()

    tokens, endings = store_of(runner).steps[-1]
    assert [(job_id, token.text) for job_id, token in tokens] == [
        (short.job.id, "x"),
        (long.job.id, "x"),
    ]
    assert [(job.id, job.status, job.output.text) for job in endings] == [
        (short.job.id, JobStatus.SUCCEEDED, "x")
    ]
    assert endings[0].output.finish_reason == "length" and endings[0].usage.completion_tokens == 1
    assert set(runner.in_flight.jobs) == {long.job.id}
    # The runner's state follows its jobs: Running, with the largest batch it stepped.
    assert store_of(runner).published[-1].status == RunnerStatus.RUNNING
    assert runner.outbox.state.largest_batch == 2 and runner.outbox.state.active_jobs == 1


def test_a_job_handed_over_twice_runs_once_in_its_latest_attempt(runner: Runner) -> None:
    """A runner that died with its inbox unread leaves the job's hand-over to the next runner
    of its name, which also gets the job's next attempt (exo_tasks.direct makes it likelier):
    neither is refused as a duplicate, and the later attempt is the one that runs."""
    first = submit()
    runner.in_flight.admit(first)
    runner.in_flight.admit(first)  # the same attempt again: dropped
    later = first.job.model_copy(update={"attempts": 1})
    runner.in_flight.admit(first.model_copy(update={"job": later}))
    runner.in_flight.admit(first)  # the earlier attempt, late: dropped
    assert runner.outbox.endings == []  # no refusal
    assert runner.in_flight.jobs[first.job.id].record.attempts == 1
    assert list(engine_of(runner).jobs) == [first.job.id]
    runner._step()
    assert len(engine_of(runner).jobs) == 1 and engine_of(runner).sampled[first.job.id] == 1


def test_a_succeeded_jobs_prefixes_are_written_with_its_end_and_no_other_jobs(
    runner: Runner,
) -> None:
    """Its conversation's next turn is routed here (exo_tasks.prefix_routing) from the write
    that ends it on; a job that failed or was cancelled gives no hint."""
    chat = JobRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    succeeded, cancelled, failed = submit(), submit(), submit()
    for command in (succeeded, cancelled, failed):
        max_tokens = 1 if command is succeeded else 4
        command.job.request = chat.model_copy(update={"max_tokens": max_tokens})
        runner.in_flight.admit(command)
    runner._step()  # the first job's one token: it succeeded
    runner.in_flight.end(cancelled.job.id, JobStatus.CANCELLED, "cancelled")
    runner.in_flight.end(failed.job.id, JobStatus.FAILED, None, "the test's")
    runner.outbox.drain()

    digests = prefix_routing.conversation_digests(chat, "x")
    assert store_of(runner).hints == [PrefixHint("tiny", digests, "unit", 900.0)]


def test_a_stop_after_another_keeps_the_sooner_deadline_and_requeue() -> None:
    warm = StopRunner(mode="warm", timeout_s=30, requeue=True)
    first = warm.after(None, 0.0, now=100.0)
    assert first == (warm, 130.0)

    later_warm = StopRunner(mode="warm", timeout_s=300).after(*first, now=110.0)
    assert later_warm == (StopRunner(mode="warm", timeout_s=300, requeue=True), 130.0)

    hard = StopRunner(mode="hard").after(*first, now=110.0)
    assert hard == (StopRunner(mode="hard", requeue=True), 110.0)


class JobsOfTheStore(RunnerWrites):
    """The runner's writes, and the job records they leave (a step's endings, a requeue)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, JobRecord] = {}
        self.released: list[str] = []
        jobs, runners = cast(Any, self.jobs), cast(Any, self.runners)
        jobs.get, jobs.requeue = self.get, self.requeue
        runners.release_job = lambda runner_id, job_id: self.released.append(job_id)

    def get(self, job_id: str) -> JobRecord | None:
        for _, endings in self.steps:  # first writer wins
            self.records.update((j.id, j) for j in endings if not self.records[j.id].is_terminal)
        return self.records.get(job_id)

    def requeue(self, job_id: str, *, only_from: str, only_attempt: int) -> JobRecord | None:
        job = self.get(job_id)
        if job is None or job.is_terminal or (job.owner, job.attempts) != (only_from, only_attempt):
            return None
        self.records[job_id] = job.model_copy(update={"status": JobStatus.QUEUED, "owner": None})
        return self.records[job_id]


def test_a_check_requeues_only_a_job_its_runner_no_longer_holds(runner: Runner) -> None:
    """The recovery loop's question (exo_tasks.recovery, a Redis failover that lost endings),
    one for all the runner's jobs: answered after the commands before it and after the
    runner's own endings are written."""
    store = JobsOfTheStore()
    runner.store = runner.in_flight.store = cast(Store, store)
    runner.outbox.writer.jobs = store.jobs
    handed, ended, lost, later, also_lost = (submit() for _ in range(5))
    for command in (handed, ended, lost, later, also_lost):
        command.job.owner = "host:1:1"
        store.records[command.job.id] = command.job
    later.job.attempts = 1  # asked about attempt 0: a later attempt is not the one asked about
    store.records[later.job.id] = later.job
    runner.in_flight.admit(ended)

    def check(command: SubmitJob) -> JobCheck:
        return JobCheck(job_id=command.job.id, owner="host:1:1", attempt=0)

    for queued in (
        handed,  # its hand-over, then at once the question: it is held by then
        CancelJob(job_id=ended.job.id),  # ended in the same round: written before the answer
        # `lost` and `also_lost`: running in the store, held by no runner (endings lost).
        CheckJobs(jobs=[check(c) for c in (handed, ended, lost, later, also_lost)]),
    ):
        runner.commands.put(queued)
    runner._take_commands(0.0)

    runner.outbox.drain()
    assert set(runner.in_flight.jobs) == {handed.job.id}
    assert store.records[ended.job.id].status == JobStatus.CANCELLED
    assert store.records[lost.job.id].status == JobStatus.QUEUED
    assert store.records[also_lost.job.id].status == JobStatus.QUEUED
    assert store.records[later.job.id].status == JobStatus.RUNNING
    assert store.released == [lost.job.id, also_lost.job.id]
