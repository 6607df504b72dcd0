"""BatchEngine on the real tiny model: batched output must equal each job generated alone."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import pytest

from exo_tasks.runner import sampling
from exo_tasks.runner.engine import BatchEngine
from exo_tasks.types import ChatMessage, SamplingParams
from tests.support.engine import Run, alone

PROMPTS = [
    "Hello",
    "The quick brown fox",
    "a",
    "Once upon a time",
    "1 2 3",
    "xyz",
    "Lorem ipsum dolor sit amet",
    "?",
]


# The step at which mlx-lm's BatchGenerator gives a prompt its first token.
GENERATOR_FIRST_STEP = 3


@pytest.fixture(
    params=[(1, None), (2, None), (2, 0)], ids=["one_lane", "two_lanes", "two_lanes_no_budget"]
)
def engine(tiny_loaded: tuple[Any, Any], request: pytest.FixtureRequest) -> Iterator[BatchEngine]:
    """The CPU's default prefill budget, and none (a GPU's)."""
    lanes, budget = request.param
    engine = BatchEngine(*tiny_loaded, lanes=lanes, prefill_token_budget=budget)
    yield engine
    engine.close()


@pytest.mark.parametrize("late", [False, True], ids=["together", "late_joiners"])
def test_batched_greedy_jobs_match_generation_alone(
    tiny_loaded: tuple[Any, Any], engine: BatchEngine, late: bool
) -> None:
    run = Run(engine)
    lengths = {str(i): 30 + 3 * i for i in range(len(PROMPTS))}  # staggered finishes
    first, rest = (PROMPTS[:4], PROMPTS[4:]) if late else (PROMPTS, [])
    for i, prompt in enumerate(first):
        run.add(str(i), prompt, max_tokens=lengths[str(i)])
    if late:
        # Let the first jobs get well into decoding before the others arrive.
        while sum(len(run.deltas[str(i)]) for i in range(4)) < 4 * 5:
            run.step()
        for i, prompt in enumerate(rest, start=4):
            run.add(str(i), prompt, max_tokens=lengths[str(i)])
    run.until_done()

    assert engine.largest_batch == 8
    for i, prompt in enumerate(PROMPTS):
        text, tokens = alone(tiny_loaded, prompt, lengths[str(i)])
        assert run.text(str(i)) == text
        assert run.last(str(i)).completion_tokens == tokens
        assert run.last(str(i)).finish_reason == "length"


def test_eos_stops_a_job_unless_ignore_eos(engine: BatchEngine) -> None:
    # This tiny model samples EOS at token 24 for seed 7; greedy text never reaches it.
    run = Run(engine)
    sampled = {"temperature": 1.0, "seed": 7, "max_tokens": 40}
    run.add("eos", "Hello", **sampled)
    run.add("ignore", "Hello", **sampled, ignore_eos=True)
    run.until_done()

    assert run.last("eos").finish_reason == "stop"
    assert run.last("eos").completion_tokens == 24
    assert len(run.text("eos")) == 23  # one character per token, and the EOS is not text
    assert run.last("ignore").finish_reason == "length"
    assert run.last("ignore").completion_tokens == 40
    assert len(run.deltas["ignore"]) == 40
    assert run.text("ignore").startswith(run.text("eos"))


def test_stop_string_cuts_output_and_is_never_streamed(
    tiny_loaded: tuple[Any, Any], engine: BatchEngine
) -> None:
    full, _ = alone(tiny_loaded, "Hello", 60)
    stop = full[20:24]
    expected = full[: full.index(stop)]
    # A stop string whose first characters end the output: held back, then flushed at the end.
    tail = full[-3:] + "~~~"
    assert tail not in full

    run = Run(engine)
    run.add("cut", "Hello", max_tokens=60, stop=["never-there", stop])
    run.add("flush", "Hello", max_tokens=60, stop=[tail])
    run.add("other", "a", max_tokens=60)
    run.until_done()

    assert run.text("cut") == expected
    assert run.last("cut").finish_reason == "stop"
    assert all(stop not in d.text for d in run.deltas["cut"])
    assert run.text("flush") == full
    assert run.last("flush").finish_reason == "length"
    assert run.text("other") == alone(tiny_loaded, "a", 60)[0]


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(engine: BatchEngine) -> None:
    seeded = {"temperature": 1.0, "seed": 7, "max_tokens": 20}
    solo = Run(engine)
    solo.add("seeded", "Once upon a time", **seeded)
    solo.add("seed8", "Once upon a time", **{**seeded, "seed": 8})
    solo.until_done()
    assert solo.text("seeded") != solo.text("seed8")

    batch = Run(engine)
    batch.add("greedy", "Hello", max_tokens=30)
    batch.add("hot", "xyz", max_tokens=30, temperature=0.7)
    batch.add("nucleus", "xyz", max_tokens=30, temperature=0.9, top_p=0.8, seed=3)
    for _ in range(4):
        batch.step()
    batch.add("seeded", "Once upon a time", **seeded)  # joins mid-generation
    batch.add("hot2", "a", max_tokens=30, temperature=0.7)
    batch.until_done()
    assert batch.text("seeded") == solo.text("seeded")


def test_remove_cancels_one_job_and_leaves_the_others(
    tiny_loaded: tuple[Any, Any], engine: BatchEngine
) -> None:
    run = Run(engine)
    for i, prompt in enumerate(PROMPTS[:4]):
        run.add(str(i), prompt, max_tokens=40)
    run.add("queued", "never started", max_tokens=40)
    engine.remove("queued")  # cancelled before its prefill
    while not run.deltas["0"]:
        run.step()
    for _ in range(5):
        run.step()
    engine.remove("1")  # cancelled mid-decode
    engine.remove("1")  # a second cancel (a race with finishing) is harmless
    assert engine.active_jobs == 3
    tokens_at_removal = len(run.deltas["1"])
    run.until_done()

    assert not run.deltas["queued"]
    assert len(run.deltas["1"]) == tokens_at_removal
    for i in (0, 2, 3):
        assert run.text(str(i)) == alone(tiny_loaded, PROMPTS[i], 40)[0]


def test_invalid_jobs_are_refused_and_the_engine_keeps_working(
    tiny_loaded: tuple[Any, Any], engine: BatchEngine
) -> None:
    run = Run(engine)
    run.add("ok", "Hello", max_tokens=30)
    run.step()
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add("empty", [], SamplingParams.model_validate({}))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add("zero", [5], SamplingParams.model_construct(max_tokens=0))
    with pytest.raises(ValueError, match="already"):
        engine.add("ok", [5], SamplingParams.model_validate({}))
    run.add("after", "a", max_tokens=30)
    run.until_done()

    assert engine.active_jobs == 0
    assert run.text("ok") == alone(tiny_loaded, "Hello", 30)[0]
    assert run.text("after") == alone(tiny_loaded, "a", 30)[0]


def test_encode_and_warmup(tiny_loaded: tuple[Any, Any], engine: BatchEngine) -> None:
    _, tokenizer = tiny_loaded
    messages = [ChatMessage(role="user", content="Hi there")]
    chat = [{"role": "user", "content": "Hi there"}]
    expected = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert engine.encode(None, messages) == list(expected)
    assert engine.encode("Hi", None) == tokenizer.encode("Hi")
    with pytest.raises(ValueError):
        engine.encode("Hi", messages)

    engine.warmup()
    assert engine.active_jobs == 0
    run = Run(engine)
    run.add("first", "Hello", max_tokens=10)
    run.until_done()
    assert run.text("first") == alone(tiny_loaded, "Hello", 10)[0]


def test_jobs_are_spread_over_lanes_that_step_together(tiny_loaded: tuple[Any, Any]) -> None:
    engine = BatchEngine(*tiny_loaded, lanes=2)
    try:
        run = Run(engine)
        for i, prompt in enumerate(PROMPTS[:3]):
            run.add(str(i), prompt, max_tokens=12)
        assert engine.lanes == 2 and engine.lane_jobs == [3, 0]  # too few to split
        for i, prompt in enumerate(PROMPTS[3:6], start=3):
            run.add(str(i), prompt, max_tokens=12)
        assert engine.lane_jobs == [4, 2]  # the second lane opens once the first holds 4
        while not all(run.deltas[str(i)] for i in range(6)):
            run.step()
        assert engine.largest_batch == 6  # one step sampled for the jobs of both lanes
        run.add("late", PROMPTS[6], max_tokens=12)
        assert engine.lane_jobs == [4, 3]  # a newcomer goes to the lane with fewer jobs
        run.until_done()
        assert engine.lane_jobs == [0, 0]
        for i, prompt in enumerate(PROMPTS[:6]):
            assert run.text(str(i)) == alone(tiny_loaded, prompt, 12)[0]
        assert run.text("late") == alone(tiny_loaded, PROMPTS[6], 12)[0]
    finally:
        engine.close()


# Distinct prompts of 40-60 tokens (the tiny model's tokenizer is one character a token).
LONG_PROMPTS = [f"{i} " + "once upon a time " * (2 + i) for i in range(3)]
SHORT = "Hello there, how are you today?"  # ~31 tokens


@pytest.mark.parametrize("budget", [0, 32], ids=["no_budget", "budget"])
def test_prompts_that_arrive_together_are_prefilled_one_at_a_time_within_the_budget(
    tiny_loaded: tuple[Any, Any], budget: int
) -> None:
    engine = BatchEngine(*tiny_loaded, lanes=1, prefill_token_budget=budget)
    try:
        run = Run(engine)
        for i, prompt in enumerate(LONG_PROMPTS):
            run.add(str(i), prompt, max_tokens=8)
        run.until_done()
        first_steps = [run.first_step[str(i)] for i in range(len(LONG_PROMPTS))]
        # Every prompt in a step waits for the whole step: with the budget the first gets its
        # first token after its own prefill, not after all three.
        if budget:
            assert first_steps[0] < first_steps[1] < first_steps[2]
        else:
            assert first_steps[0] == first_steps[1] == first_steps[2]
        for i, prompt in enumerate(LONG_PROMPTS):
            assert run.text(str(i)) == alone(tiny_loaded, prompt, 8)[0]
    finally:
        engine.close()


def test_a_short_prompt_joins_a_long_ones_prefill_and_ends_it_where_it_ends(
    tiny_loaded: tuple[Any, Any],
) -> None:
    """A long prompt takes its prefill budget step after step; a short one arriving meanwhile
    is not held back until it is done, and neither is padded to the other (same text)."""
    engine = BatchEngine(*tiny_loaded, lanes=1, prefill_token_budget=32)
    try:
        run = Run(engine)
        # Two of these alone exceed the budget: it joins as the long one's step shrinks to it.
        long_prompt = "".join(f"{i} little pigs; " for i in range(60))  # ~800 tokens
        run.add("long", long_prompt, max_tokens=8)
        run.step()  # its first chunk of PREFILL_STEP_SIZE tokens
        run.add("short", SHORT, max_tokens=8)
        run.until_done()
        assert run.text("long") == alone(tiny_loaded, long_prompt, 8)[0]
        assert run.text("short") == alone(tiny_loaded, SHORT, 8)[0]
        # As soon as the generator gives a joining prompt its first token (three steps: the
        # prompt but its last token, the last token, the token out), well before the long
        # one's first token.
        assert run.first_step["short"] - 1 == GENERATOR_FIRST_STEP
        assert run.first_step["long"] > run.first_step["short"] + 2
    finally:
        engine.close()


def test_a_long_prompt_paced_beside_a_decoding_job_keeps_both_texts(
    tiny_loaded: tuple[Any, Any],
) -> None:
    """While a job decodes, a long prompt's steps are paced in time (prefill_pace): the job
    gets a token at every step of that prefill and both greedy texts are the ones alone. How
    long those steps take is `make bench`'s (section stallfree)."""
    engine = BatchEngine(*tiny_loaded, lanes=1, prefill_token_budget=32)
    try:
        run = Run(engine)
        # Outlasts the prompt's prefill at its smallest chunks (MIN_CHUNK: 100 steps).
        run.add("bystander", "bystander", max_tokens=200, ignore_eos=True)
        while len(run.deltas["bystander"]) < 3:
            run.step()
        long_prompt = "".join(f"{i} little pigs; " for i in range(60))  # ~800 tokens
        run.add("long", long_prompt, max_tokens=8)
        while not run.deltas["long"]:
            streamed = len(run.deltas["bystander"])
            run.step()
            assert len(run.deltas["bystander"]) == streamed + 1
        run.until_done()
        assert run.text("long") == alone(tiny_loaded, long_prompt, 8)[0]
        assert run.text("bystander") == alone(tiny_loaded, "bystander", 200)[0]
    finally:
        engine.close()


def test_lanes_share_the_batch_limit_and_never_outnumber_it(tiny_loaded: tuple[Any, Any]) -> None:
    one_at_a_time = BatchEngine(
        *tiny_loaded, completion_batch_size=1, prefill_batch_size=1, lanes=4
    )
    try:
        assert one_at_a_time.lanes == 1
    finally:
        one_at_a_time.close()


class Boom(RuntimeError):
    pass


def raising_after(calls: int, sampler: Any) -> Any:
    """A sampler that works `calls` times, then raises: a fault only one job brings."""
    count = 0

    def sample(logprobs: Any) -> Any:
        nonlocal count
        count += 1
        if count > calls:
            raise Boom("bad sampler")
        return sampler(logprobs)

    return sample


@pytest.mark.parametrize("calls", [0, 5], ids=["in_prefill", "mid_decode"])
def test_a_jobs_own_sampler_failing_fails_that_job_alone(
    tiny_loaded: tuple[Any, Any],
    engine: BatchEngine,
    monkeypatch: pytest.MonkeyPatch,
    calls: int,
) -> None:
    seeded = sampling._seeded_sampler
    monkeypatch.setattr(
        sampling,
        "_seeded_sampler",
        lambda params, seed: raising_after(calls, seeded(params, seed)) if seed == 13 else None,
    )
    run = Run(engine)
    for i, prompt in enumerate(PROMPTS[:3]):
        run.add(str(i), prompt, max_tokens=20)
    run.add("bad", "Hello", max_tokens=20, temperature=0.7, seed=13)
    run.until_done()

    assert run.last("bad").error == "sampling failed: Boom('bad sampler')"
    assert run.last("bad").completion_tokens <= calls + 1
    for i, prompt in enumerate(PROMPTS[:3]):
        assert run.text(str(i)) == alone(tiny_loaded, prompt, 20)[0]
        assert run.last(str(i)).finish_reason == "length"


def test_a_failing_lane_fails_its_jobs_alone_and_starts_over(
    tiny_loaded: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        sampling,
        "make_sampler",
        # Greedy while it works: a sampled first token can be EOS, and a job that ends before the
        # third call never brings the fault.
        lambda t, **kwargs: raising_after(2, lambda logprobs: mx.argmax(logprobs, axis=-1)),
    )
    engine = BatchEngine(*tiny_loaded, lanes=2)
    try:
        run = Run(engine)
        for i, prompt in enumerate(PROMPTS[:4]):  # fill lane 1 to LANE_MIN_JOBS ...
            run.add(str(i), prompt, max_tokens=20)
        run.add("bad", "Hello", max_tokens=20, temperature=0.5)  # ... so this opens lane 2
        assert engine.lane_jobs == [4, 1]
        run.until_done()

        assert run.last("bad").error == "generation failed: Boom('bad sampler')"
        for i, prompt in enumerate(PROMPTS[:4]):
            assert run.text(str(i)) == alone(tiny_loaded, prompt, 20)[0]
        # The failed lane was made again, empty, and serves the next jobs.
        assert engine.lane_jobs == [0, 0]
        for i, prompt in enumerate(PROMPTS[:5]):
            run.add(f"after-{i}", prompt, max_tokens=10)
        assert engine.lane_jobs == [4, 1]
        run.until_done()
        for i, prompt in enumerate(PROMPTS[:5]):
            assert run.text(f"after-{i}") == alone(tiny_loaded, prompt, 10)[0]
    finally:
        engine.close()


def test_a_lone_one_token_job_gets_it_from_one_pass_sampled_as_in_a_batch(
    tiny_loaded: tuple[Any, Any], engine: BatchEngine
) -> None:
    """A 1-token job alone in an idle engine: its token from one forward pass over its prompt,
    at the first step (not the generator's third): greedy as mlx-lm's own generation, seeded as
    in a batch. A longer job alone keeps the generator's steps (first_token's docstring)."""
    lone = Run(engine)
    lone.add("greedy", "Once upon a time", max_tokens=1)
    assert [(d.job_id, d.finish_reason) for d in lone.step()] == [("greedy", "length")]
    assert engine.active_jobs == 0 and engine.lane_jobs == [0] * engine.lanes
    assert lone.text("greedy") == alone(tiny_loaded, "Once upon a time", 1)[0]
    for seed in (7, 8, 9):
        seeded = {"temperature": 1.0, "seed": seed, "max_tokens": 1}
        lone.add(f"seeded{seed}", "Once upon a time", **seeded)
        lone.until_done()
        batch = Run(engine)
        batch.add("other", "xyz", max_tokens=20)
        batch.add(f"seeded{seed}", "Once upon a time", **seeded)
        batch.until_done()
        assert batch.first_step[f"seeded{seed}"] >= GENERATOR_FIRST_STEP  # the generator's
        assert lone.text(f"seeded{seed}") == batch.text(f"seeded{seed}")
    longer = Run(engine)
    longer.add("longer", "Once upon a time", max_tokens=20)
    longer.until_done()
    assert longer.first_step["longer"] == GENERATOR_FIRST_STEP
    assert longer.text("longer") == alone(tiny_loaded, "Once upon a time", 20)[0]


def test_a_lone_jobs_pass_starts_from_its_cached_prefix_and_a_long_rest_uses_the_generator(
    tiny_loaded: tuple[Any, Any],
) -> None:
    engine = BatchEngine(*tiny_loaded, lanes=1, prefill_step_size=64, prompt_cache_bytes=1 << 26)
    try:
        run = Run(engine)
        story = "Once upon a time there was a queue of jobs, " * 3
        run.add("first", story, max_tokens=4)
        run.until_done()
        before = run.steps
        run.add("again", story + "and then", max_tokens=1)
        run.until_done()
        assert run.first_step["again"] == before + 1  # its token at its first step
        assert (run.deltas["again"][0].cached_tokens or 0) > 0  # from the first job's prompt
        assert run.text("again") == alone(tiny_loaded, story + "and then", 1)[0]
        # More than a step's prefill left to compute: the generator's steps, as before.
        long_prompt = "".join(f"{i} little pigs; " for i in range(12))
        start = run.steps
        run.add("long", long_prompt, max_tokens=1)
        run.until_done()
        assert run.first_step["long"] - start > 1
        assert run.text("long") == alone(tiny_loaded, long_prompt, 1)[0]
    finally:
        engine.close()
