"""The time-limit policy: a job's soft and hard limits, and the cap that keeps both below the
broker's redelivery. Pure: the API, the task and the config all ask here.

Celery's Redis transport hands an unacknowledged message out again once it is older than the
visibility timeout, whether or not its task still runs (celery#5935). So a job's hard limit must
end the job before that: a job that may run longer than the visibility timeout is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

# Between a job's hard limit and its message's redelivery: the task's own cleanup after the kill.
VISIBILITY_MARGIN_S = 5.0


class LimitSettings(Protocol):
    job_soft_time_limit_s: float
    job_hard_grace_s: float
    broker_visibility_timeout_s: float


@dataclass(frozen=True)
class JobLimits:
    """Seconds from a job's start: `soft` ends it `timed_out` with its partial text, `hard`
    kills the pool child that follows it (the job then ends `failed`)."""

    soft_s: float
    hard_s: float

    def deadlines(self, now: float) -> tuple[float, float]:
        """(soft, hard) as Unix times for a job that starts at `now`."""
        return now + self.soft_s, now + self.hard_s


def max_timeout_s(settings: LimitSettings) -> float:
    """The largest `timeout_s` a job may ask for: its hard limit stays below redelivery."""
    return settings.broker_visibility_timeout_s - settings.job_hard_grace_s - VISIBILITY_MARGIN_S


def job_limits(timeout_s: float | None, settings: LimitSettings) -> JobLimits:
    """A job's limits: its own `timeout_s` (already validated against the cap) or the default."""
    soft = settings.job_soft_time_limit_s if timeout_s is None else timeout_s
    return JobLimits(soft_s=soft, hard_s=soft + settings.job_hard_grace_s)


def check_timeout(timeout_s: float, cap: float) -> float:
    """A job's `timeout_s`, or ValueError naming the cap and the settings it comes from."""
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError("must be a finite number of seconds above 0")
    if timeout_s > cap:
        raise ValueError(
            f"must be at most {cap:g} s (EXO_BROKER_VISIBILITY_TIMEOUT_S - EXO_JOB_HARD_GRACE_S "
            f"- {VISIBILITY_MARGIN_S:g} s), so that a running job's message is never delivered "
            "again"
        )
    return timeout_s


def check_settings(settings: LimitSettings) -> None:
    """Refuse a default soft limit that could outlive the broker's visibility timeout."""
    cap = max_timeout_s(settings)
    if settings.job_soft_time_limit_s > cap:
        raise ValueError(
            f"EXO_JOB_SOFT_TIME_LIMIT_S={settings.job_soft_time_limit_s:g} is above "
            f"{cap:g} s: a job's hard limit (soft + EXO_JOB_HARD_GRACE_S + "
            f"{VISIBILITY_MARGIN_S:g} s) must stay below EXO_BROKER_VISIBILITY_TIMEOUT_S="
            f"{settings.broker_visibility_timeout_s:g}, or a running job is delivered twice"
        )
