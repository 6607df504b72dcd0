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
# The jobs handed over directly whose task is yet to be sent, scored by when it is due
# (exo_tasks.direct).
DIRECT_TASKS_DUE = f"{PREFIX}:direct:due"
# Instance ids (exo_tasks.instances).
INSTANCES = f"{PREFIX}:instances"


JobStream = Literal["events", "endings"]
RunnerPart = Literal["jobs", "inbox", "history", "step"]


def job_key(job_id: str, stream: JobStream | None = None) -> str:
    """The job's hash (`status`, `record`, `queue`, `priority`, `client`, `owner`, `runner`,
    `cancel`), or one of its streams: `events` (every token, requeue and ending), `endings`
    (how each attempt ended: what a task waits on)."""
    key = f"{PREFIX}:job:{job_id}"
    return key if stream is None else f"{key}:{stream}"


def client_key(client: str, priority: str) -> str:
    """A sorted set: the ids of a client's jobs of one priority class that wait in a queue
    (exo_tasks.fairness), scored by creation time."""
    return f"{PREFIX}:client:{client}:waiting:{priority}"


def hub_wake_key(hub_id: str) -> str:
    """A stream an API process's event reader reads with its jobs' streams: an entry wakes its
    blocking read (exo_tasks.api.streams)."""
    return f"{PREFIX}:hub:{hub_id}:wake"


def events_key(job_id: str) -> str:
    return job_key(job_id, "events")


def endings_key(job_id: str) -> str:
    return job_key(job_id, "endings")


def transition_keys(job_id: str) -> list[str]:
    """The keys a job's transition script touches, in its KEYS order."""
    return [job_key(job_id), events_key(job_id), endings_key(job_id), ACTIVE_JOBS]


def runner_key(runner_id: str, part: RunnerPart | None = None) -> str:
    """The runner's state (JSON), or one of its parts: the `jobs` handed to it and not yet
    ended (a set), its `inbox` of commands and its status `history` (lists), the mark of its
    last `step` write."""
    key = f"{PREFIX}:runner:{runner_id}"
    return key if part is None else f"{key}:{part}"


InstancePart = Literal["ranks", "addresses"]


def instance_key(instance_id: str, part: InstancePart | None = None) -> str:
    """The instance's hash (`record`, `status`, `generation`), or one of its parts, each a hash
    by rank and cleared when a new generation starts: its `ranks`' latest records and the
    `addresses` (`host|port`) its ranks listen on for the ring."""
    key = f"{PREFIX}:instance:{instance_id}"
    return key if part is None else f"{key}:{part}"


def rank_wake_key(instance_id: str, generation: int, rank: int) -> str:
    """The list an idle follower rank of `generation` waits on for rank 0's word that its
    next plan comes (exo_tasks.runner.schedule)."""
    return f"{instance_key(instance_id)}:wake:{generation}:{rank}"


def host_key(host: str) -> str:
    """The host's heartbeat (JSON, expiring)."""
    return f"{PREFIX}:host:{host}"


def prefix_key(model: str, digest: str) -> str:
    """The host that ran a prompt prefix of `model` lately (exo_tasks.prefix_routing)."""
    return f"{PREFIX}:prefix:{model}:{digest}"


def supervisor_key(host: str) -> str:
    """A list: requests to the host's runner supervisor."""
    return f"{PREFIX}:supervisor:{host}"


# Files (OpenAI's Files API): ids scored by creation time; each file's metadata (a hash) and
# its bytes (a string, so that a batch reads one line with GETRANGE).
FILES = f"{PREFIX}:files"
# Batches: ids scored by creation time, the ones the feeder still has to drive, its lease.
BATCHES = f"{PREFIX}:batches"
BATCHES_OPEN = f"{PREFIX}:batches:open"
BATCH_FEEDER_LEASE = f"{PREFIX}:batches:lease"

FilePart = Literal["content"]
BatchPart = Literal["spans", "inflight", "results"]


def file_key(file_id: str, part: FilePart | None = None) -> str:
    key = f"{PREFIX}:file:{file_id}"
    return key if part is None else f"{key}:{part}"


def batch_key(batch_id: str, part: BatchPart | None = None) -> str:
    """The batch's hash (`status`, `record`, `cursor`, `completed`, `failed`), or one of its
    parts while it runs: the byte `spans` of its requests in the input file (a list), the line
    numbers `inflight` as jobs (a set), and each ended line's `results` (a hash)."""
    key = f"{PREFIX}:batch:{batch_id}"
    return key if part is None else f"{key}:{part}"
