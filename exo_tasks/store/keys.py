"""The layout of everything exo_tasks keeps in Redis (kombu's own keys: exo_tasks.broker)."""

from __future__ import annotations

from typing import Literal

PREFIX = "exo"

# Job ids, scored by creation time (the job list), and the ids of the jobs queued or running.
RECENT_JOBS = f"{PREFIX}:jobs"
ACTIVE_JOBS = f"{PREFIX}:jobs:active"
RUNNERS = f"{PREFIX}:runners"
HOSTS = f"{PREFIX}:hosts"
RECOVERY_LEASE = f"{PREFIX}:recovery:lease"


JobStream = Literal["events", "endings"]
RunnerPart = Literal["jobs", "inbox", "history"]


def job_key(job_id: str, stream: JobStream | None = None) -> str:
    """The job's hash (`status`, `record`, `queue`, `owner`, `runner`, `cancel`), or one of its
    streams: `events` (every token, requeue and ending), `endings` (how each attempt ended:
    what a task waits on)."""
    key = f"{PREFIX}:job:{job_id}"
    return key if stream is None else f"{key}:{stream}"


def events_key(job_id: str) -> str:
    return job_key(job_id, "events")


def endings_key(job_id: str) -> str:
    return job_key(job_id, "endings")


def transition_keys(job_id: str) -> list[str]:
    """The keys a job's transition script touches, in its KEYS order."""
    return [job_key(job_id), events_key(job_id), endings_key(job_id), ACTIVE_JOBS]


def runner_key(runner_id: str, part: RunnerPart | None = None) -> str:
    """The runner's state (JSON), or one of its parts: the `jobs` handed to it and not yet
    ended (a set), its `inbox` of commands and its status `history` (lists)."""
    key = f"{PREFIX}:runner:{runner_id}"
    return key if part is None else f"{key}:{part}"


def host_key(host: str) -> str:
    """The host's heartbeat (JSON, expiring)."""
    return f"{PREFIX}:host:{host}"


def supervisor_key(host: str) -> str:
    """A list: requests to the host's runner supervisor."""
    return f"{PREFIX}:supervisor:{host}"
