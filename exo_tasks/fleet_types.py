"""What hosts and runners publish about themselves (Redis; GET /v1/runners and /v1/hosts):
runner statuses and states, their status history, and host heartbeats. Pure, like types.py."""

from __future__ import annotations

import enum
from datetime import datetime

from pydantic import BaseModel, Field

from exo_tasks.types import utcnow


class RunnerStatus(enum.StrEnum):
    """The runner's lifecycle, as exo's runner supervisor names it."""

    WAITING_FOR_MODEL = "WaitingForModel"
    LOADING = "Loading"
    LOADED = "Loaded"
    WARMING_UP = "WarmingUp"
    READY = "Ready"
    RUNNING = "Running"
    SHUTTING_DOWN = "ShuttingDown"
    SHUTDOWN = "Shutdown"
    FAILED = "Failed"
    UNLOADED = "Unloaded"  # idle, its process gone: the next job for the model loads it again

    @property
    def accepts_jobs(self) -> bool:
        return self in (RunnerStatus.READY, RunnerStatus.RUNNING)

    @property
    def serves(self) -> bool:
        """Takes jobs now, or loads its model again for the next one."""
        return self.accepts_jobs or self is RunnerStatus.UNLOADED

    @property
    def is_final(self) -> bool:
        return self in (RunnerStatus.SHUTDOWN, RunnerStatus.FAILED)


class StatusChange(BaseModel):
    status: RunnerStatus
    at: datetime
    error: str | None = None


class RunnerState(BaseModel):
    """A runner as published to Redis and shown by GET /v1/runners."""

    id: str
    host: str
    model: str
    status: RunnerStatus
    pid: int | None = None
    active_jobs: int = 0
    largest_batch: int = 0
    weights_bytes: int | None = Field(
        None, description="Bytes of model parameters the runner holds (a rank: its shard's)."
    )
    prompt_cache_bytes: int = Field(
        0, description="Bytes of KV state in the runner's prompt cache (EXO_PROMPT_CACHE_BYTES)."
    )
    memory_bytes: int | None = Field(
        None,
        description="Bytes of MLX memory the runner's model uses now: its parameters, KV caches "
        "and buffers (MLX's active memory; the process's Python and libraries are not in it).",
    )
    peak_memory_bytes: int | None = Field(
        None, description="The most MLX memory the runner's process has used since it started."
    )
    lanes: int = Field(1, description="Batches run side by side (one per CPU core on the CPU).")
    tool_calling: bool | None = Field(
        None, description="Whether the model's chat template takes tools (known once loaded)."
    )
    model_loads: int = 0
    restarts: int = 0
    error: str | None = None
    next_restart_at: datetime | None = Field(
        None, description="Set while a failed runner waits to be restarted."
    )
    started_at: datetime | None = None
    updated_at: datetime = Field(default_factory=utcnow)

    @property
    def is_down(self) -> bool:
        """Stopped or failed for good: no restart is coming (only a load brings it back)."""
        return self.status.is_final and self.next_restart_at is None

    @property
    def loadable(self) -> bool:
        """A load (POST /v1/runners) starts it: down for good, or its idle model unloaded."""
        return self.is_down or self.status is RunnerStatus.UNLOADED


class HostState(BaseModel):
    """A worker host as it announces itself in Redis while it runs (an expiring heartbeat)."""

    name: str
    pid: int
    incarnation: str = Field(
        "", description="This run of the worker: jobs it holds name it as their owner."
    )
    held: list[str] = Field(
        default_factory=list,
        description="Delivery tags of the broker messages this worker holds unacknowledged.",
    )
    models: list[str] = Field(description="Slugs of the models this host serves.")
    concurrency: int | None = Field(None, description="Pool children: tasks it runs at once.")
    started_at: datetime
    updated_at: datetime = Field(default_factory=utcnow)
    stopping: bool = Field(
        False,
        description="Its worker's shutdown has begun: it takes no jobs and serves no route any "
        "more, and still owns the jobs it drains or requeues until it is gone.",
    )
