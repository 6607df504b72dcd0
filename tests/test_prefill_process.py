"""Long prompts prefilled in a process of their own (EXO_PREFILL_PROCESS_MIN_TOKENS,
exo_tasks.runner.prefiller): the engine in process with the `tiny` model and a real prefill
process, a decoding bystander beside each long prompt. How much it spares the bystander's gaps
is `make bench`'s (section stallfree)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from exo_tasks.runner import prefiller as prefiller_module
from exo_tasks.runner.engine import BatchEngine, weights_bytes
from exo_tasks.runner.lane import Lane
from exo_tasks.runner.prefiller import Prefiller
from tests.support.engine import Run, alone
from tests.support.processes import Processes
from tests.support.stack import Stack
from tests.support.workers import start_worker, wait_runner_ready

LONG_PROMPT = "".join(f"{i} little pigs; " for i in range(60))  # ~800 tokens
MIN_TOKENS = 256
STEP_SIZE = 256
GONE_WITHIN_S = 5.0


@pytest.fixture
def prefiller(tiny_model: Path, tiny_loaded: tuple[Any, Any]) -> Iterator[Prefiller]:
    prefiller = Prefiller(str(tiny_model), MIN_TOKENS, STEP_SIZE, weights_bytes(tiny_loaded[0]))
    assert prefiller.start() and prefiller.wait_ready(60)
    yield prefiller
    prefiller.close()  # it waits for the process (or kills it)


# How many steps the process takes over a prompt depends on the machine and its load: a bystander
# that must decode through it is given more tokens than it could need and removed after.
UNENDING = 100_000


def _beside_a_bystander(
    loaded: tuple[Any, Any], prefiller: Prefiller, max_tokens: int
) -> Iterator[Run]:
    engine = BatchEngine(*loaded, lanes=1, prefill_token_budget=32, prefill_process=prefiller)
    run = Run(engine)
    run.add("bystander", "bystander", max_tokens=max_tokens, ignore_eos=True)
    while len(run.deltas["bystander"]) < 3:
        run.step()
    yield run
    engine.close()


@pytest.fixture
def run(tiny_loaded: tuple[Any, Any], prefiller: Prefiller) -> Iterator[Run]:
    yield from _beside_a_bystander(tiny_loaded, prefiller, 300)


@pytest.fixture
def watched(tiny_loaded: tuple[Any, Any], prefiller: Prefiller) -> Iterator[Run]:
    """A bystander that decodes until the test removes it."""
    yield from _beside_a_bystander(tiny_loaded, prefiller, UNENDING)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _running(process: psutil.Process) -> bool:
    """Alive, and not a zombie waiting to be reaped (its parent is gone)."""
    try:
        status: str = process.status()
    except psutil.NoSuchProcess:
        return False
    return status != str(psutil.STATUS_ZOMBIE)


def _loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The jobs whose first token and KV state the engine took from the prefill process."""
    took: list[str] = []
    first_token = Prefiller.first_token

    def spy(done: Any, job: Any) -> Any:
        first = first_token(done, job)
        if first is not None:
            took.append(job.job_id)
        return first

    monkeypatch.setattr(Prefiller, "first_token", staticmethod(spy))
    return took


def test_a_long_prompt_is_prefilled_by_its_process_and_both_texts_are_alones(
    tiny_loaded: tuple[Any, Any], watched: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bystander gets a token at every step while the process computes the prompt; the
    prompt's first token comes with its return, sampled from the process's logits, and the
    prompt cache did not give it: its usage counts no cached token."""
    run = watched
    took = _loads(monkeypatch)
    run.add("long", LONG_PROMPT, max_tokens=8)
    back_at = None
    while not run.deltas["long"]:
        streamed = len(run.deltas["bystander"])
        run.step()
        assert len(run.deltas["bystander"]) == streamed + 1
        if took and back_at is None:
            back_at = run.steps
    assert took == ["long"]
    assert back_at is not None and run.first_step["long"] == back_at
    assert run.deltas["long"][0].cached_tokens == 0
    while run.last("long").finish_reason is None:
        run.step()
    run.engine.remove("bystander")
    assert run.text("long") == alone(tiny_loaded, LONG_PROMPT, 8)[0]
    streamed = len(run.deltas["bystander"])
    assert alone(tiny_loaded, "bystander", streamed)[0].startswith(run.text("bystander"))


def test_while_the_process_computes_one_lane_fewer_steps_at_once(
    tiny_loaded: tuple[Any, Any], prefiller: Prefiller, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two lanes of decoding jobs step side by side, but one after the other while the process
    computes a prompt: it keeps a core busy, so a lane more than the cores left would make every
    decoding job wait for the cores' sharing."""
    spans: list[tuple[int, float, float]] = []  # (step, start, end) of each lane's advance
    advance = Lane.advance

    def timed(lane: Lane, *args: Any) -> Any:
        start = time.monotonic()
        try:
            return advance(lane, *args)
        finally:
            spans.append((driven.steps, start, time.monotonic()))

    monkeypatch.setattr(Lane, "advance", timed)
    engine = BatchEngine(*tiny_loaded, lanes=2, prefill_token_budget=32, prefill_process=prefiller)
    driven = Run(engine)
    computing: dict[int, bool] = {}  # step -> whether the process held a prompt in it

    def step_once() -> None:
        at = driven.steps
        driven.step()
        computing[at] = prefiller.computing  # it changes only before a step's advance

    try:
        for i in range(8):
            driven.add(f"bystander {i}", f"bystander {i}", max_tokens=UNENDING, ignore_eos=True)
        while min(len(d) for d in driven.deltas.values()) < 3:
            step_once()
        assert engine.lane_jobs == [4, 4]
        # Three times the long prompt (~2,400 tokens): the steps while it computes are the ones
        # this test looks at, and ~800 tokens gave only two of them on a loaded machine.
        driven.add("long", LONG_PROMPT * 3, max_tokens=8)
        while not driven.deltas["long"]:
            step_once()
        by_step: dict[int, list[tuple[float, float]]] = {}
        for step, start, end in spans:
            by_step.setdefault(step, []).append((start, end))

        def overlap(step: int) -> bool:
            (a_start, a_end), (b_start, b_end) = by_step[step]
            return a_start < b_end and b_start < a_end

        during = [step for step, held in computing.items() if held]
        beside = [step for step, held in computing.items() if not held]
        assert len(during) >= 3, computing
        assert not [step for step in during if overlap(step)]
        assert [step for step in beside if overlap(step)], "two lanes never stepped together"
    finally:
        engine.close()


def _eos(loaded: tuple[Any, Any]) -> int:
    return int(min(loaded[1].eos_token_ids))


# Ways a job's first token is sampled or ends the job: the process's must be its lane's.
FIRST_TOKENS: dict[str, dict[str, Any]] = {
    "seeded, penalised, with logprobs": {
        "max_tokens": 12,
        "temperature": 0.9,
        "seed": 7,
        "repetition_penalty": 1.3,
        "logprobs": True,
        "top_logprobs": 3,
    },
    "one token: it never joins a lane": {"max_tokens": 1},
    "a stop string in the first token": {"max_tokens": 12, "stop": ["A"]},  # its text: "Ad..."
}


@pytest.mark.parametrize("case", [*FIRST_TOKENS, "EOS first"])
def test_a_first_token_from_the_process_is_the_one_its_lane_samples(
    tiny_loaded: tuple[Any, Any], prefiller: Prefiller, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's first token, sampled in the runner from the process's logits, and all that
    follows from it (text, log-probabilities, its end) are what the lane gives the same job
    with no prefill process."""
    eos_first = {"max_tokens": 12, "logit_bias": {_eos(tiny_loaded): 100}}
    params = FIRST_TOKENS.get(case) or eos_first
    took = _loads(monkeypatch)
    inserted: list[str] = []  # the jobs that joined a lane's generator (its only way in)
    insert = Lane._insert

    def spy(lane: Lane, job: Any, lookup: Any) -> int:
        inserted.append(job.job_id)
        return insert(lane, job, lookup)

    monkeypatch.setattr(Lane, "_insert", spy)
    runs = []
    for process in (prefiller, None):
        engine = BatchEngine(*tiny_loaded, lanes=1, prefill_process=process)
        runs.append(Run(engine))
        runs[-1].add("long", LONG_PROMPT, **params)
        runs[-1].until_done()
        engine.close()
        if process is not None:  # a job joins its lane only if its first token did not end it
            went_on = len(runs[-1].deltas["long"]) > 1
            assert inserted == (["long"] if went_on else []), inserted
            inserted.clear()
    assert took == ["long"]
    with_process, lane_alone = (r.deltas["long"] for r in runs)
    assert [d.text for d in with_process] == [d.text for d in lane_alone]
    assert [(d.completion_tokens, d.finish_reason) for d in with_process] == [
        (d.completion_tokens, d.finish_reason) for d in lane_alone
    ]
    assert [d.logprobs for d in with_process] == [d.logprobs for d in lane_alone]
    if case in ("EOS first", "a stop string in the first token"):
        assert [(d.text, d.finish_reason) for d in with_process] == [("", "stop")]


def test_a_short_prompt_stays_with_its_lane(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    took = _loads(monkeypatch)
    run.add("short", "one little pig", max_tokens=4)
    run.until_done()
    assert took == [] and run.last("short").finish_reason == "length"


def test_a_prompt_whose_process_died_is_prefilled_by_its_lane(
    tiny_loaded: tuple[Any, Any], run: Run, prefiller: Prefiller, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL while the process holds the prompt: nothing is lost, the lane does it, and later
    long prompts stay with the lanes."""
    took = _loads(monkeypatch)
    run.add("long", LONG_PROMPT, max_tokens=8)
    run.step()  # the lane hands it over
    assert prefiller.pid is not None
    _kill(prefiller.pid)
    run.until_done()
    assert took == []
    assert run.text("long") == alone(tiny_loaded, LONG_PROMPT, 8)[0]
    assert run.last("bystander").finish_reason == "length"
    run.add("again", LONG_PROMPT, max_tokens=8)
    run.until_done()
    assert took == [] and run.text("again") == run.text("long")


def test_a_job_cancelled_in_the_process_is_dropped_and_its_state_removed(
    run: Run, prefiller: Prefiller, monkeypatch: pytest.MonkeyPatch
) -> None:
    took = _loads(monkeypatch)
    run.add("long", LONG_PROMPT, max_tokens=8)
    run.step()
    run.engine.remove("long")
    run.add("next", LONG_PROMPT + " again", max_tokens=4)  # after it in the process's queue
    while not run.deltas["next"]:
        run.step()
    run.until_done()
    assert run.deltas["long"] == [] and took == ["next"]
    assert prefiller._dir is not None and not list(prefiller._dir.iterdir())


def test_the_process_exits_when_its_runner_is_killed(tiny_model: Path) -> None:
    """However the runner ends (SIGKILL here, mid-prompt), its prefill process goes too."""
    code = (
        "import sys, types\n"
        "from exo_tasks.runner.prefiller import Prefiller\n"
        f"prefiller = Prefiller({str(tiny_model)!r}, 1, 8, 0)\n"
        "prefiller.start()\n"
        "print(prefiller.pid, flush=True)\n"
        "job = types.SimpleNamespace(job_id='j', prompt=[7] * 4000)\n"
        "prefiller.takes(job, job.prompt)\n"
        "sys.stdin.read()\n"
    )
    runner = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    helper = None
    try:
        assert runner.stdout is not None
        helper = psutil.Process(int(runner.stdout.readline()))
        deadline = time.monotonic() + 30
        while helper.cpu_times().user < 1.0 and time.monotonic() < deadline:
            time.sleep(0.1)  # loading, then computing
        assert _running(helper), "the prefill process never ran: nothing to outlive"
        runner.kill()
        runner.wait()
        deadline = time.monotonic() + GONE_WITHIN_S
        while _running(helper) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(helper), "the prefill process outlived its runner"
    finally:
        runner.kill()
        runner.wait()
        if helper is not None and _running(helper):
            helper.kill()  # psutil checks it is still that process


def _helpers(runner_pid: int) -> list[psutil.Process]:
    """The runner's prefill processes."""
    children = psutil.Process(runner_pid).children()
    return [p for p in children if "exo_tasks.runner.prefiller" in p.cmdline()]


def test_a_workers_runner_starts_its_prefill_process_at_the_first_long_prompt(
    tiny_loaded: tuple[Any, Any],
    stack: Stack,
    processes: Processes,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """A real worker at its defaults (EXO_PREFILL_PROCESS_MIN_TOKENS 512): its runner starts
    no prefill process, and a short prompt none, until a long prompt comes; that one goes
    there beside a decoding job and both texts are alone's; the worker's warm stop ends the
    prefill process with its runner."""
    worker = start_worker(processes, stack.redis.url, "host-p", [tiny_model], tmp_path)
    state = wait_runner_ready(stack.store, worker)
    assert state.pid is not None
    short = stack.api.submit(prompt="one little pig", max_tokens=4, host="host-p")
    assert stack.api.wait_job(short)["status"] == "succeeded"
    assert _helpers(state.pid) == [], "a prefill process before any long prompt"
    bystander = stack.api.submit(
        prompt="bystander", max_tokens=2000, ignore_eos=True, host="host-p"
    )
    long = stack.api.submit(prompt=LONG_PROMPT, max_tokens=8, host="host-p")
    assert stack.api.wait_job(long)["output"]["text"] == alone(tiny_loaded, LONG_PROMPT, 8)[0]
    assert stack.api.wait_job(bystander)["status"] == "succeeded"
    sent = [
        line for line in worker.log_text().splitlines() if "sent to the prefill process" in line
    ]
    assert len(sent) == 1 and long in sent[0], sent
    (helper,) = _helpers(state.pid)
    worker.process.send_signal(signal.SIGTERM)
    worker.process.wait(60)
    deadline = time.monotonic() + GONE_WITHIN_S
    while _running(helper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(helper), "the prefill process outlived its worker"


def test_without_room_for_a_second_copy_the_process_never_starts_and_lanes_prefill(
    tiny_model: Path, tiny_loaded: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model that the host's available memory does not hold twice over gets no prefill
    process: a long prompt is prefilled by its lane, as with none."""
    took = _loads(monkeypatch)
    available = psutil.virtual_memory().available
    prefiller = Prefiller(str(tiny_model), MIN_TOKENS, STEP_SIZE, available // 2 + (1 << 30))
    engine = BatchEngine(*tiny_loaded, lanes=1, prefill_process=prefiller)
    run = Run(engine)
    try:
        run.add("long", LONG_PROMPT, max_tokens=8)
        run.until_done()
        assert prefiller.pid is None and took == []
        assert run.text("long") == alone(tiny_loaded, LONG_PROMPT, 8)[0]
    finally:
        engine.close()


def test_a_process_that_does_not_load_in_time_is_killed_and_its_prompts_go_to_their_lanes(
    tiny_model: Path,
    tiny_loaded: tuple[Any, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model whose load hangs (its config a FIFO nobody writes): the waiting counts as the
    prompt's progress until LOAD_TIMEOUT_S (shortened here: the bound is the subject), then the
    process is killed and the lane prefills the prompt."""
    hanging = tmp_path / "hanging-model"
    hanging.mkdir()
    os.mkfifo(hanging / "config.json")
    monkeypatch.setattr(prefiller_module, "LOAD_TIMEOUT_S", 3.0)
    prefiller = Prefiller(str(hanging), MIN_TOKENS, STEP_SIZE, 0)
    engine = BatchEngine(*tiny_loaded, lanes=1, prefill_process=prefiller)
    run = Run(engine)
    try:
        started = time.monotonic()
        run.add("long", LONG_PROMPT, max_tokens=8)
        run.step()
        assert prefiller.pid is not None and prefiller.computing
        helper = psutil.Process(prefiller.pid)
        assert engine.prefill_chunks == 1, "the load is not counted as progress"
        run.until_done()
        assert time.monotonic() - started >= 3.0
        assert not _running(helper)
        assert run.text("long") == alone(tiny_loaded, LONG_PROMPT, 8)[0]
    finally:
        engine.close()
