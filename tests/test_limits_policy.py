"""The time-limit policy (exo_tasks/limits.py), pure."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from exo_tasks import limits


@dataclass
class Limits:
    job_soft_time_limit_s: float = 600.0
    job_hard_grace_s: float = 30.0
    broker_visibility_timeout_s: float = 3600.0


def test_a_jobs_limits_come_from_its_timeout_or_the_default() -> None:
    assert limits.job_limits(None, Limits()) == limits.JobLimits(600.0, 630.0)
    assert limits.job_limits(2.5, Limits()) == limits.JobLimits(2.5, 32.5)
    assert limits.JobLimits(2.5, 32.5).deadlines(100.0) == (102.5, 132.5)


def test_the_cap_keeps_the_hard_limit_below_redelivery() -> None:
    cap = limits.max_timeout_s(Limits())
    assert cap == 3565.0
    assert cap + Limits().job_hard_grace_s + limits.VISIBILITY_MARGIN_S == 3600.0
    assert limits.check_timeout(cap, cap) == cap
    for bad in (cap + 0.001, math.inf, math.nan, 0.0, -1.0):
        with pytest.raises(ValueError):
            limits.check_timeout(bad, cap)


def test_settings_whose_default_limit_outlives_redelivery_are_refused() -> None:
    limits.check_settings(Limits())
    with pytest.raises(ValueError, match="EXO_BROKER_VISIBILITY_TIMEOUT_S=60"):
        limits.check_settings(Limits(broker_visibility_timeout_s=60))
