"""Rank 0's schedule shared with the other ranks (exo_tasks.runner.schedule), without a ring:
a channel that hands rank 0's plans to a follower in memory, and engines that record what is
done to them (or real ones, with the `tiny` model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from exo_tasks.runner.engine import BatchEngine
from exo_tasks.runner.lane import TokenDelta
from exo_tasks.runner.prefill_pace import MIN_CHUNK, PrefillPace
from exo_tasks.runner.schedule import (
    AddJob,
    Diverged,
    LeaderEngine,
    PeerLost,
    RemoveJob,
    StepPlan,
    follow,
)
from exo_tasks.runner.sigterm import PATIENCE_S, Collectives
from exo_tasks.types import SamplingParams


class Recorder:
    """An engine that records its calls; each step ends the jobs named in `ending`."""

    def __init__(self, chunk: int | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.ending: list[str] = []
        self.active_jobs = 0
        self.weights_bytes = 1
        self.chunk = chunk  # what its own clock would prefill per step

    def add(self, job_id: str, prompt_tokens: list[int], params: SamplingParams) -> None:
        self.calls.append(("add", job_id, prompt_tokens, params.seed))

    def remove(self, job_id: str) -> None:
        self.calls.append(("remove", job_id))

    def admit_waiting(self) -> list[TokenDelta]:
        return []

    def prefill_sizes(self) -> list[int | None]:
        return [self.chunk]

    def advance(self, chunks: list[int | None]) -> list[TokenDelta]:
        self.calls.append(("step", chunks))
        return [TokenDelta(job_id, "x", 1, "length") for job_id in self.ending]

    def warmup(self) -> None:
        self.calls.append(("warmup",))

    def close(self) -> None:
        self.calls.append(("close",))


class Wire:
    """Plans as JSON, in order, as the ring carries them."""

    def __init__(self, fail_with: str | None = None) -> None:
        self.plans: list[str] = []
        self.fail_with = fail_with

    def send(self, plan: StepPlan) -> None:
        if self.fail_with:
            raise RuntimeError(self.fail_with)
        self.plans.append(plan.model_dump_json())

    def receive(self) -> StepPlan:
        return StepPlan.model_validate_json(self.plans.pop(0))


def leader(wire: Wire, collectives: Collectives | None = None) -> tuple[LeaderEngine, Recorder]:
    engine = Recorder(chunk=32)
    collectives = collectives or Collectives()
    return LeaderEngine(cast(Any, engine), cast(Any, wire), collectives, lambda: None), engine


def test_a_follower_runs_rank_0_s_operations_in_its_order_with_the_same_seeds() -> None:
    wire = Wire()
    lead, engine = leader(wire)
    lead.warmup()
    lead.add("a", [1, 2], SamplingParams())
    lead.add("b", [3], SamplingParams.model_validate({"temperature": 0.7}))
    lead.step()
    lead.remove("a")
    lead.add("c", [4], SamplingParams.model_validate({"temperature": 0.7, "seed": 9}))
    lead.step()
    lead.close()
    follower = Recorder(chunk=8)  # a slower host: its own clock would prefill less a step
    begun: list[tuple[int, int]] = []
    ended: list[None] = []
    follow(
        cast(Any, follower),
        cast(Any, wire),
        lambda *counts: begun.append(counts),
        lambda: ended.append(None),
        lambda: None,
    )
    assert follower.calls == engine.calls
    seeds = {call[1]: call[3] for call in engine.calls if call[0] == "add"}
    assert seeds["a"] is None  # greedy: nothing to draw
    assert isinstance(seeds["b"], int) and seeds["c"] == 9  # every sampled job has a seed
    # Two steps timed by the watchdog (warmup is not one), each begun with two jobs without a
    # token yet (the recorder samples none); three ends (warmup's too); close ends the loop.
    assert [awaiting for _, awaiting in begun] == [2, 2] and len(ended) == 3 and not wire.plans


def test_an_emptied_batch_sends_the_followers_off_the_ring_until_the_next_plan() -> None:
    """mlx's ring polls its socket while a receive waits: an idle follower must not wait there
    (it kept a core busy). Rank 0's step that empties its batch is followed by an `idle` plan;
    its next plan comes once it has woken the followers, and a follower waits for that word
    after each `idle` plan, before the plan that follows it."""
    wire = Wire()
    engine = Recorder(chunk=32)
    woken: list[int] = []  # how many plans were sent when rank 0 woke the followers
    lead = LeaderEngine(
        cast(Any, engine), cast(Any, wire), Collectives(), lambda: woken.append(len(wire.plans))
    )
    engine.active_jobs = 1
    lead.add("a", [1], SamplingParams())
    lead.step()  # a job left: the followers stay on the ring
    engine.active_jobs = 0
    lead.step()  # the batch emptied: idle
    lead.step()  # woken first
    lead.close()  # woken first
    actions = [StepPlan.model_validate_json(plan).action for plan in wire.plans]
    assert actions == ["step", "step", "idle", "step", "idle", "close"]
    assert woken == [3, 5]
    waited: list[int] = []  # how many plans were left to read when the follower waited
    follower = Recorder()
    follow(
        cast(Any, follower),
        cast(Any, wire),
        lambda *_: None,
        lambda: None,
        lambda: waited.append(len(wire.plans)),
    )
    assert waited == [3, 1] and follower.calls == engine.calls


def test_a_follower_that_ended_other_jobs_than_rank_0_fails() -> None:
    wire = Wire()
    lead, engine = leader(wire)
    lead.add("a", [1], SamplingParams())
    engine.ending = ["a"]
    lead.step()
    lead.step()  # carries rank 0's ending of "a"
    follower = Recorder()  # it ends nothing
    with pytest.raises(Diverged, match="rank 0 ended"):
        follow(cast(Any, follower), cast(Any, wire), lambda *_: None, lambda: None, lambda: None)


def test_a_lost_ring_peer_is_peer_lost_not_a_crash_of_the_loop() -> None:
    lead, _ = leader(Wire(fail_with="[ring] connection to a peer was lost"))
    with pytest.raises(PeerLost):
        lead.step()
    assert not issubclass(PeerLost, Exception)  # the loop's `except Exception` lets it pass
    other, _ = leader(Wire(fail_with="some other error"))
    with pytest.raises(RuntimeError, match="some other error"):
        other.step()


def test_plans_carry_only_what_the_engine_uses() -> None:
    plan = StepPlan(ops=[AddJob(job_id="a", prompt_tokens=[1], params=SamplingParams())])
    plan.ops.append(RemoveJob(job_id="a"))
    assert StepPlan.model_validate_json(plan.model_dump_json()) == plan


def test_rank_0_is_inside_a_collective_while_it_steps_and_blocked_once_past_its_patience() -> None:
    """What rank 0's SIGTERM thread reads (exo_tasks.runner.sigterm): a step (plan and model)
    is inside a collective; between steps the main thread is not."""
    collectives = Collectives()
    rank0, engine = leader(Wire(), collectives)
    seen: list[float | None] = []

    def advance(chunks: list[int | None]) -> list[TokenDelta]:
        seen.append(collectives.since)
        return []

    engine.advance = advance  # type: ignore[method-assign]
    rank0.step()
    assert seen[0] is not None and collectives.since is None
    collectives.since = 100.0  # inside one since t=100
    assert not collectives.blocked(termed=90.0, now=100.0 + PATIENCE_S / 2)
    assert collectives.blocked(termed=90.0, now=100.0 + PATIENCE_S * 1.5)
    # SIGTERM came later than the collective began: the patience runs from SIGTERM.
    assert not collectives.blocked(termed=105.0, now=105.0 + PATIENCE_S / 2)
    assert collectives.blocked(termed=105.0, now=105.0 + PATIENCE_S * 1.5)
    collectives.since = None
    assert not collectives.blocked(termed=0.0, now=1000.0)


class SlowHost(PrefillPace):
    """A follower on a host whose steps take longer: its own pacing would prefill less."""

    def chunk(self, budget_s: float, rows: int, most: int) -> int:
        return MIN_CHUNK


def test_a_follower_prefills_rank_0_s_chunks_whatever_its_own_clock_says(
    tiny_model: Path,
) -> None:
    """A long prompt paced in time beside a decoding job (exo_tasks.runner.prefill_pace), the
    real engine: each follower step prefills what rank 0's did, and ends the same jobs. (A
    follower that sized its chunks by its own clock ran other passes of the model than rank 0:
    on a ring, both ranks then waited for ever in collectives the other never entered.)"""
    from mlx_lm import load

    model, tokenizer = load(str(tiny_model))[:2]
    engines = [BatchEngine(model, tokenizer, lanes=1, prefill_token_budget=32) for _ in "ab"]
    lead_engine, follower = engines
    for lane in follower._lanes:
        lane.pace = SlowHost()
    wire = Wire()
    lead = LeaderEngine(lead_engine, cast(Any, wire), Collectives(), lambda: None)
    prefilled: list[list[int | None]] = []
    advance = follower.advance

    def recorded(chunks: list[int | None]) -> list[TokenDelta]:
        prefilled.append(chunks)
        return advance(chunks)

    follower.advance = recorded  # type: ignore[method-assign]
    try:
        greedy = SamplingParams.model_validate({"max_tokens": 40, "ignore_eos": True})
        lead.add("bystander", tokenizer.encode("bystander"), greedy)
        for _ in range(3):
            lead.step()
        long_prompt = tokenizer.encode("".join(f"{i} little pigs; " for i in range(20)))
        lead.add("long", long_prompt, greedy.model_copy(update={"max_tokens": 4}))
        while lead_engine.active_jobs:
            lead.step()
        lead.close()
        sent = [StepPlan.model_validate_json(plan).chunks for plan in wire.plans]
        # Diverged if it ended other jobs.
        follow(follower, cast(Any, wire), lambda *_: None, lambda: None, lambda: None)
    finally:
        follower.close()
    assert prefilled == [chunks for chunks in sent if chunks]
    assert any(chunks[0] not in (None, MIN_CHUNK) for chunks in prefilled)  # paced by rank 0
