"""The runner supervisor, in the worker's main process: start, watch, restart and stop runners.

Runners are spawned (never forked: a process that ran MLX cannot fork safely) and watched by
their process sentinels, so a dead runner is noticed at once, with or without a last word.
Stopping follows a fixed escalation, each step logged: ask → grace → SIGTERM → 5 s → SIGKILL →
5 s → "resources may have leaked".
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import signal
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from multiprocessing.process import BaseProcess
from typing import cast

from config.settings import Settings, model_slug
from exo_tasks import runner
from exo_tasks.store import Store
from exo_tasks.types import RunnerState, RunnerStatus, StopRunner, runner_id_for, utcnow

log = logging.getLogger("exo_tasks.supervisor")
TERM_WAIT_S = 5.0
KILL_WAIT_S = 5.0
WATCH_INTERVAL_S = 0.2
# A runner that stayed up this long had recovered: its next crash starts a new count.
HEALTHY_UPTIME_S = 60.0


def exit_cause(exitcode: int | None) -> str:
    """exo's wording: 'Terminated (signal 9 SIGKILL)' for a signal, 'exitcode=N' otherwise."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        return f"Terminated (signal {-exitcode} {signal.Signals(-exitcode).name})"
    return f"exitcode={exitcode}"


def restart_backoff_s(failures_in_a_row: int) -> float:
    return float(min(30.0, 0.5 * 2 ** max(failures_in_a_row - 1, 0)))


@dataclass
class RunnerHandle:
    spec: runner.RunnerSpec
    process: BaseProcess | None = None
    started_monotonic: float = 0.0
    failures_in_a_row: int = 0
    restarts: int = 0
    stopping: bool = False
    restart_at: float | None = None


class RunnerSupervisor:
    """One runner process per model this host serves."""

    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
        self.host = settings.hostname
        self.handles: dict[str, RunnerHandle] = {}
        self._lock = threading.RLock()
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="runner-watch", daemon=True)
        for model_path in settings.served_models:
            slug = model_slug(model_path)
            spec = runner.RunnerSpec(
                runner_id=runner_id_for(slug, self.host),
                host=self.host,
                model=slug,
                model_path=model_path,
                redis_url=settings.effective_redis_url,
                result_ttl_s=settings.result_expires_s,
                completion_batch_size=settings.completion_batch_size,
                prefill_batch_size=settings.prefill_batch_size,
                log_level=settings.log_level,
            )
            self.handles[spec.runner_id] = RunnerHandle(spec)

    # --- starting and watching ---

    def start(self) -> None:
        for handle in self.handles.values():
            self._spawn(handle)
        self._watcher.start()

    def _spawn(self, handle: RunnerHandle) -> None:
        spec = handle.spec
        self.store.publish_runner(
            RunnerState(
                id=spec.runner_id,
                host=spec.host,
                model=spec.model,
                status=RunnerStatus.WAITING_FOR_MODEL,
                restarts=handle.restarts,
            )
        )
        process = multiprocessing.get_context("spawn").Process(
            target=runner.main,
            args=(spec.model_copy(update={}).model_dump_json(),),
            name=f"runner {spec.runner_id}",
        )
        process.start()
        handle.process, handle.started_monotonic = process, time.monotonic()
        handle.stopping, handle.restart_at = False, None
        log.info("runner started", extra={"runner": spec.runner_id, "pid": process.pid})

    def _watch(self) -> None:
        while not self._closing.is_set():
            with self._lock:
                alive = {
                    h.process.sentinel: h
                    for h in self.handles.values()
                    if h.process is not None and h.process.exitcode is None
                }
            ready = multiprocessing.connection.wait(list(alive), timeout=WATCH_INTERVAL_S)
            for sentinel in ready:
                self._on_exit(alive[cast(int, sentinel)])
            self._restart_due()

    def _on_exit(self, handle: RunnerHandle) -> None:
        with self._lock:
            process = handle.process
            if process is None or handle.restart_at is not None:
                return
            cause = exit_cause(process.exitcode)
            runner_id = handle.spec.runner_id
            if handle.stopping:
                self._record_stop(handle, cause)
                return
            log.error("runner died", extra={"runner": runner_id, "cause": cause})
            state = self.store.get_runner(runner_id)
            failed = self.store.fail_runner_jobs(runner_id, f"runner {runner_id} died: {cause}")
            if failed:
                log.error(
                    "jobs failed with their runner",
                    extra={"runner": runner_id, "jobs": ",".join(failed)},
                )
            uptime = time.monotonic() - handle.started_monotonic
            handle.failures_in_a_row = (
                1 if uptime > HEALTHY_UPTIME_S else handle.failures_in_a_row + 1
            )
            gave_up = handle.failures_in_a_row > self.settings.runner_max_restarts
            error = (
                cause
                if not gave_up
                else (f"{cause}; gave up after {handle.failures_in_a_row} failures in a row")
            )
            delay = restart_backoff_s(handle.failures_in_a_row)
            restart_at = None if gave_up else utcnow() + timedelta(seconds=delay)
            self._publish_final(handle, state, RunnerStatus.FAILED, error, restart_at)
            if gave_up:
                log.critical(
                    "runner keeps failing; not restarting it",
                    extra={"runner": runner_id, "failures": handle.failures_in_a_row},
                )
                handle.process = None
                return
            handle.restart_at = time.monotonic() + delay
            log.warning("runner restarts soon", extra={"runner": runner_id, "in_s": delay})

    def _restart_due(self) -> None:
        with self._lock:
            for handle in self.handles.values():
                if handle.restart_at is not None and time.monotonic() >= handle.restart_at:
                    handle.restarts += 1
                    handle.spec = handle.spec.model_copy(update={"restarts": handle.restarts})
                    self._spawn(handle)

    def _publish_final(
        self,
        handle: RunnerHandle,
        last: RunnerState | None,
        status: RunnerStatus,
        error: str | None,
        next_restart_at: datetime | None = None,
    ) -> None:
        spec = handle.spec
        base = last or RunnerState(
            id=spec.runner_id, host=spec.host, model=spec.model, status=status
        )
        self.store.publish_runner(
            base.model_copy(
                update={
                    "status": status,
                    "error": error,
                    "active_jobs": 0,
                    "updated_at": utcnow(),
                    "restarts": handle.restarts,
                    "next_restart_at": next_restart_at,
                }
            ),
            status_changed=True,
        )

    def _record_stop(self, handle: RunnerHandle, cause: str) -> None:
        """An intended stop: exit 0 after `Shutdown` is clean; anything else is a failure."""
        runner_id = handle.spec.runner_id
        state = self.store.get_runner(runner_id)
        clean = (
            cause == "exitcode=0" and state is not None and state.status == RunnerStatus.SHUTDOWN
        )
        if not clean:
            self.store.fail_runner_jobs(runner_id, f"runner {runner_id} stopped: {cause}")
            self._publish_final(handle, state, RunnerStatus.FAILED, cause)
        log.info("runner stopped", extra={"runner": runner_id, "cause": cause, "clean": clean})
        handle.process = None

    # --- stopping ---

    def stop_runner(self, runner_id: str, command: StopRunner, grace_s: float) -> str:
        """Stop one runner by the escalation; returns the exit cause."""
        with self._lock:
            handle = self.handles[runner_id]
            process = handle.process
            handle.stopping, handle.restart_at = True, None
        if process is None:
            return "not running"
        extra = {"runner": runner_id, "pid": process.pid}
        log.info("stopping runner", extra={**extra, "mode": command.mode, "grace_s": grace_s})
        self.store.send_to_runner(runner_id, command)
        process.join(grace_s)
        if process.exitcode is None:
            log.warning("runner did not stop within grace; sending SIGTERM", extra=extra)
            process.terminate()
            process.join(TERM_WAIT_S)
        if process.exitcode is None:
            log.error("runner ignored SIGTERM; sending SIGKILL", extra=extra)
            process.kill()
            process.join(KILL_WAIT_S)
        if process.exitcode is None:
            log.critical("runner survived SIGKILL; resources may have leaked", extra=extra)
            return "still running"
        self._on_exit(handle)
        return exit_cause(process.exitcode)

    def stop(self, mode: str = "warm") -> None:
        """Stop every runner in parallel, by the escalation."""
        grace = self.settings.runner_shutdown_grace_s if mode == "warm" else 0.0
        command = StopRunner(mode="warm" if mode == "warm" else "hard", timeout_s=grace)
        threads = [
            threading.Thread(target=self.stop_runner, args=(runner_id, command, grace + 1.0))
            for runner_id, handle in self.handles.items()
            if handle.process is not None
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self._closing.set()

    def terminate(self) -> None:
        """Cold shutdown: stop now."""
        self.stop(mode="hard")
