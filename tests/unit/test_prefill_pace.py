"""The prefill pace: a step's prompt tokens follow their measured cost, within the budget."""

from __future__ import annotations

import pytest

from exo_tasks.runner.prefill_pace import MIN_CHUNK, MIN_STEP_S, PrefillPace, step_budget


def test_the_chunk_fits_the_budget_at_the_measured_cost_per_token() -> None:
    pace = PrefillPace()
    assert pace.chunk(0.2, 1, 256) == MIN_CHUNK  # nothing measured yet
    pace.observe(0.1, 0, decoded=True)  # a decode step
    pace.observe(0.5, 20, decoded=True)  # 0.4 s of prefill for 20 tokens: 20 ms each
    assert pace.token_s == pytest.approx(0.02)
    assert pace.chunk(0.2, 1, 256) == 10
    assert pace.chunk(0.2, 2, 256) == MIN_CHUNK  # two prompts share the step
    assert pace.chunk(10.0, 1, 256) == 256  # never more than the step size


def test_timing_noise_never_makes_a_prompt_token_look_free() -> None:
    pace = PrefillPace(decode_s=1.0)
    pace.observe(0.6, 10, decoded=True)  # faster than the decode step alone
    assert pace.token_s == pytest.approx(0.03)  # half the step counted as prefill


def test_a_step_may_prefill_for_as_long_as_the_slowest_decode_step_or_the_floor() -> None:
    assert step_budget([None]) == MIN_STEP_S
    assert step_budget([0.01, None]) == MIN_STEP_S
    assert step_budget([0.3, 0.5]) == 0.5
