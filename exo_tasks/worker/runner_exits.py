"""What a runner's exit leads to, as the supervisor records it in Redis: an intended stop stays
`Shutdown` (its jobs requeued or failed); a crash or a hang fails its jobs and sets a restart
after a backoff (bounded; none for a configuration error); an idle unload requeues what was
handed over as it exited, and is not restarted. The supervisor (`exo_tasks.worker.supervisor`)
starts the process again when `restart_at` is due; nothing here starts or signals a process.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta

from config.settings import Settings
from exo_tasks import lifecycle
from exo_tasks.commands import StopRunner
from exo_tasks.fleet_types import RunnerState, RunnerStatus
from exo_tasks.runner import process as runner_process
from exo_tasks.store import Store
from exo_tasks.types import utcnow
from exo_tasks.worker.supervision import (
    HEALTHY_UPTIME_S,
    RunnerHandle,
    ServingCallback,
    exit_cause,
    restart_backoff_s,
)

log = logging.getLogger("exo_tasks.supervisor")


class RunnerExits:
    """The records of a host's runners' exits (ranks' excepted: their instance decides)."""

    def __init__(self, settings: Settings, store: Store, on_serving: ServingCallback) -> None:
        self.settings = settings
        self.store = store
        self.on_serving = on_serving

    def record(self, handle: RunnerHandle, exitcode: int) -> None:
        """A runner's process exited with `exitcode`: record what that means."""
        cause = exit_cause(exitcode)
        if handle.stop is not None and handle.stall is None:
            self._stopped(handle, handle.stop, cause)
        elif exitcode == runner_process.EXIT_UNLOADED:
            # Idle, it unloaded its model: no restart; the next job asks for a start. A job
            # handed over as it exited was never started: back to the queue.
            requeued = self.store.runners.requeue_jobs(handle.spec.runner_id)
            log.info("runner unloaded (idle)", extra={"runner": handle.spec.runner_id})
            if requeued:
                log.info("jobs requeued", extra={"jobs": ",".join(requeued)})
        else:
            self._failed(
                handle,
                f"{handle.stall}; {cause}" if handle.stall else cause,
                final=exitcode == runner_process.EXIT_CONFIG,
            )

    def _failed(self, handle: RunnerHandle, cause: str, *, final: bool = False) -> None:
        """A crash or a hang: fail its jobs at once, then restart it with backoff (bounded).
        `final`: a configuration error, which no restart would cure."""
        runner_id = handle.spec.runner_id
        last = self.store.runners.get(runner_id)
        if last is not None and last.status == RunnerStatus.FAILED and last.error:
            # The runner said why before it exited (a crash, a model that did not load): keep
            # its words next to the exit cause. (Its state is fresh since its spawn.)
            cause = f"{last.error} ({cause})"
        log.error("runner failed", extra={"runner": runner_id, "cause": cause})
        failed = self.store.runners.fail_jobs(runner_id, f"runner {runner_id} failed: {cause}")
        if failed:
            log.error(
                "jobs failed with their runner",
                extra={"runner": runner_id, "jobs": ",".join(failed)},
            )
        uptime = time.monotonic() - handle.started_monotonic
        handle.failures_in_a_row = 1 if uptime > HEALTHY_UPTIME_S else handle.failures_in_a_row + 1
        if final or handle.failures_in_a_row > self.settings.runner_max_restarts:
            error = (
                f"{cause}; not restarted: a configuration error"
                if final
                else f"{cause}; gave up after {handle.failures_in_a_row} failures in a row"
            )
            log.critical("runner not restarted", extra={"runner": runner_id, "error": error})
            self.publish(handle, last, RunnerStatus.FAILED, error)
            self.on_serving(handle.spec.model, False)
            return
        delay = restart_backoff_s(handle.failures_in_a_row)
        handle.restart_at = time.monotonic() + delay
        restart_at = utcnow() + timedelta(seconds=delay)
        self.publish(handle, last, RunnerStatus.FAILED, cause, restart_at)
        log.warning("runner restarts soon", extra={"runner": runner_id, "in_s": delay})

    def _stopped(self, handle: RunnerHandle, stop: StopRunner, cause: str) -> None:
        """An intended stop stays one, however the process ended: `Shutdown`, and only a load
        brings it back (jobs pinned to this host wait for it). Exit 0 after `Shutdown` is clean;
        any other exit (it needed the escalation, or crashed on its way out) is its `error`."""
        runner_id = handle.spec.runner_id
        last = self.store.runners.get(runner_id)
        clean = cause == "exitcode=0" and last is not None and last.status == RunnerStatus.SHUTDOWN
        if stop.requeue:
            self.store.runners.requeue_jobs(runner_id)
        else:
            self.store.runners.fail_jobs(runner_id, f"runner {runner_id} stopped: {cause}")
        if not clean:
            self.publish(handle, last, RunnerStatus.SHUTDOWN, cause)
        log.info("runner stopped", extra={"runner": runner_id, "cause": cause, "clean": clean})

    def publish(
        self,
        handle: RunnerHandle,
        last: RunnerState | None,
        status: RunnerStatus,
        error: str | None,
        next_restart_at: datetime | None = None,
    ) -> None:
        """Move the runner's record to `status` by the runner's transitions table, for it."""
        spec = handle.spec
        # No record yet (Redis lost it): one with this status, which is then no move.
        base = last or RunnerState(
            id=spec.runner_id, host=spec.host, model=spec.model, status=status
        )
        moved = lifecycle.move_runner(
            base,
            status,
            error=error,
            active_jobs=0,
            updated_at=utcnow(),
            restarts=handle.restarts,
            next_restart_at=next_restart_at,
        )
        if moved is not None:
            self.store.runners.publish(moved, status_changed=True)
