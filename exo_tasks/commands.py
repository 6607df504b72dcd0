"""Commands that cross a process boundary: to a runner (its Redis inbox) and to a host's runner
supervisor (from the shutdown_runner and load_runner tasks). Pure, like types.py."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from exo_tasks.types import JobRecord

# --- Commands to a runner (its Redis inbox) ---


class SubmitJob(BaseModel):
    kind: Literal["submit"] = "submit"
    job: JobRecord = Field(description="The job as its task marked it running.")
    soft_deadline: float = Field(
        description="Unix time after which the runner ends the job timed_out: the soft time "
        "limit, kept by the runner too, since the signal that brings it to the task can be lost."
    )
    deadline: float = Field(description="Unix time after which the runner drops the job (failed).")


class CancelJob(BaseModel):
    kind: Literal["cancel"] = "cancel"
    job_id: str
    reason: Literal["cancelled", "time_limit"] = "cancelled"


class JobCheck(BaseModel):
    """A job the store shows running on the asked runner, under `owner`'s attempt `attempt`."""

    job_id: str
    owner: str
    attempt: int


class CheckJobs(BaseModel):
    """From the recovery loop, one per runner and sweep, for every job the store shows running
    on this runner: a job the runner no longer holds goes back to the queue (its ending was lost
    with a Redis master that failed over before its replica had it). One command, not one per
    job: at 2,000 streams, one each was ~1,000 inbox reads a second per runner."""

    kind: Literal["checks"] = "checks"
    jobs: list[JobCheck]


class StopRunner(BaseModel):
    """Warm: finish in-flight jobs for up to `timeout_s`; hard: end them now. Jobs still running
    then end with finish_reason `shutdown`, or go back to the queue when `requeue` (the whole
    worker is stopping, so another worker or a restart will run them)."""

    kind: Literal["stop"] = "stop"
    mode: Literal["warm", "hard"] = "warm"
    timeout_s: float = Field(30.0, ge=0)
    requeue: bool = False

    def after(
        self, under_way: StopRunner | None, under_way_deadline: float, *, now: float
    ) -> tuple[StopRunner, float]:
        """This stop, arriving at `now` (monotonic) while `under_way` may be, and its deadline:
        a stop under way only gets stricter (sooner, or requeueing)."""
        deadline = now + (0 if self.mode == "hard" else self.timeout_s)
        if under_way is None:
            return self, deadline
        stricter = self.model_copy(update={"requeue": self.requeue or under_way.requeue})
        return stricter, min(deadline, under_way_deadline)


class Restate(BaseModel):
    """From its host's worker, whose heartbeat had lapsed (a stall, a busy machine) and beats
    again: another host's recovery loop took it for gone and wrote the runner Failed, which it
    is not. The runner publishes its own state again; nothing else would until a job came,
    and none comes to a Failed runner."""

    kind: Literal["restate"] = "restate"


RunnerCommand = Annotated[
    SubmitJob | CancelJob | CheckJobs | StopRunner | Restate, Field(discriminator="kind")
]


# --- Requests to a host's runner supervisor (from the shutdown_runner and load_runner tasks) ---


class StopRunnerRequest(BaseModel):
    kind: Literal["stop_runner"] = "stop_runner"
    runner_id: str
    command: StopRunner
    # The runner process it was meant for: once that one is gone (restarted since the request
    # was sent), the request is stale and ignored. None: whatever runs now.
    pid: int | None = None


class StartRunnerRequest(BaseModel):
    kind: Literal["start_runner"] = "start_runner"
    runner_id: str


SupervisorRequest = Annotated[StopRunnerRequest | StartRunnerRequest, Field(discriminator="kind")]
