"""The layout of everything exo_tasks keeps in Redis (kombu's own keys: exo_tasks.broker)."""

from __future__ import annotations

PREFIX = "exo"

# Job ids, scored by creation time (the job list), and the ids of the jobs queued or running.
RECENT_JOBS = f"{PREFIX}:jobs"
ACTIVE_JOBS = f"{PREFIX}:jobs:active"
RUNNERS = f"{PREFIX}:runners"
HOSTS = f"{PREFIX}:hosts"
RECOVERY_LEASE = f"{PREFIX}:recovery:lease"


def job_key(job_id: str) -> str:
    """A hash: `status`, `record` (JSON), `queue`, `owner`, `runner`, `cancel`."""
    return f"{PREFIX}:job:{job_id}"


def events_key(job_id: str) -> str:
    """A stream: every token, requeue and ending of the job."""
    return f"{PREFIX}:job:{job_id}:events"


def endings_key(job_id: str) -> str:
    """A stream: only how each attempt ended (what a task waits on)."""
    return f"{PREFIX}:job:{job_id}:endings"


def transition_keys(job_id: str) -> list[str]:
    """The keys a job's transition script touches, in its KEYS order."""
    return [job_key(job_id), events_key(job_id), endings_key(job_id), ACTIVE_JOBS]


def runner_key(runner_id: str) -> str:
    return f"{PREFIX}:runner:{runner_id}"


def runner_jobs_key(runner_id: str) -> str:
    """A set: the jobs handed to the runner and not yet ended."""
    return f"{runner_key(runner_id)}:jobs"


def runner_inbox_key(runner_id: str) -> str:
    return f"{runner_key(runner_id)}:inbox"


def runner_history_key(runner_id: str) -> str:
    return f"{runner_key(runner_id)}:history"


def host_key(host: str) -> str:
    return f"{PREFIX}:host:{host}"


def supervisor_key(host: str) -> str:
    """A list: requests to the host's runner supervisor."""
    return f"{PREFIX}:supervisor:{host}"
