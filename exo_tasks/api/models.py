"""The bodies and replies of the HTTP routes that no other process reads: job summaries, the
runner, host and health routes' (a job's request and record are wire models of
exo_tasks.types, shared with the processes that run jobs)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from exo_tasks.fleet_types import RunnerState, StatusChange
from exo_tasks.types import JobRecord, Priority, SamplingParams, WireModel

SUMMARY_TEXT_CHARS = 256


class RunnerShutdownBody(WireModel):
    mode: Literal["warm", "hard"] = "warm"
    timeout_s: float | None = Field(None, ge=0, le=3600)


class RunnerLoadBody(WireModel):
    model: str
    host: str | None = None


class HostShutdownBody(WireModel):
    mode: Literal["warm", "cold"] = "warm"


class RunnerShutdownReply(BaseModel):
    runner_id: str
    task_id: str
    mode: Literal["warm", "hard"]
    timeout_s: float


class RunnerLoadReply(BaseModel):
    runner_id: str
    task_id: str
    host: str


class HostShutdownReply(BaseModel):
    host: str
    mode: Literal["warm", "cold"]
    reply: dict[str, str] | None = Field(None, description="The worker's own answer.")


class HealthReply(BaseModel):
    status: Literal["ok"] = "ok"


class ReadinessReply(BaseModel):
    status: Literal["ready", "no runner ready", "unavailable"]
    redis: bool
    ready_runners: list[str]
    ready_instances: list[str] = Field(
        default_factory=list, description="Instances Ready, every one of their hosts live."
    )


class RunnerDetail(RunnerState):
    """GET /v1/runners/<id>: the runner and its status changes, oldest first."""

    history: list[StatusChange]


class HostInfo(BaseModel):
    """GET /v1/hosts: a live worker, as its heartbeat announces it, with its runners and the
    depth of each queue it consumes."""

    name: str
    node: str = Field(description="The Celery node name, exo@<host>.")
    pid: int
    concurrency: int | None = None
    models: list[str]
    runners: list[RunnerState]
    instances: list[str] = Field(
        default_factory=list, description="The instances with a rank on this host."
    )
    queues: dict[str, int] = Field(description="Messages waiting in each queue it consumes.")


class JobOptions(SamplingParams):
    """What a job asked for but its prompt or messages (JobRequest's other fields)."""

    model: str | None = None
    host: str | None = None
    priority: Priority = "normal"
    timeout_s: float | None = None
    user: str | None = None
    keep_alive: float | None = None


class JobSummary(JobRecord):
    """A job without its prompt or messages, its output text cut to SUMMARY_TEXT_CHARS and
    without logprobs: what the job list and a submission answer, so neither sends megabytes
    back (GET /v1/jobs/<id> has it all)."""

    request: JobOptions  # type: ignore[assignment]  # a summary's request has no prompt

    @classmethod
    def of(cls, job: JobRecord) -> JobSummary:
        options = JobOptions.model_construct(
            **job.request.model_dump(exclude={"prompt", "messages"})
        )
        # Log probabilities, one record per token, are left to GET /v1/jobs/<id> as well.
        cut = {"text": job.output.text[:SUMMARY_TEXT_CHARS], "logprobs": None}
        output = job.output.model_copy(update=cut)
        return cls.model_construct(**(dict(job) | {"request": options, "output": output}))
