"""The runner supervisor, in the worker's main process: start, watch, restart and stop runners.

Runners are spawned (never forked: a process that ran MLX cannot fork safely) and watched by
their process sentinels, so a dead runner is noticed at once, with or without a last word, and
by a stall watchdog over shared memory, so a hung one is noticed too. Stopping follows a fixed
escalation, each step logged: ask → grace → SIGTERM → 5 s → SIGKILL → 5 s → "resources may have
leaked". What an exit leads to (a stop recorded, a failure and its restart backoff, an idle
unload) is `exo_tasks.worker.runner_exits`'s to record; this module acts on it.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from multiprocessing.process import BaseProcess

import redis

from config.settings import Settings
from exo_tasks import lifecycle, metrics
from exo_tasks.commands import StartRunnerRequest, StopRunner, StopRunnerRequest, SupervisorRequest
from exo_tasks.fleet_types import RunnerStatus
from exo_tasks.runner import main as runner_main
from exo_tasks.runner import process as runner_process
from exo_tasks.store import Store
from exo_tasks.worker.runner_exits import RunnerExits
from exo_tasks.worker.supervision import (
    KILL_WAIT_S,
    TERM_WAIT_S,
    RankExitCallback,
    RunnerHandle,
    ServingCallback,
    StoppedCallback,
    exit_cause,
    in_thread,
)

log = logging.getLogger("exo_tasks.supervisor")
WATCH_INTERVAL_S = 0.1
CONTROL_POLL_S = 1.0
REAP_WAIT_S = 1.0
# How long a stopping worker waits for its ranks' exits to be settled (ranks.py: at most half a
# heartbeat for a peer's cause, then a few writes).
SETTLE_WAIT_S = 10.0
_spawn = multiprocessing.get_context("spawn")


class RunnerSupervisor:
    """One runner process per model this host serves."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        on_serving: ServingCallback | None = None,
        on_stopped: StoppedCallback | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.host = settings.hostname
        self.on_serving = on_serving or (lambda queue, serving: None)
        self.on_stopped = on_stopped or (lambda: None)
        self.exits = RunnerExits(settings, store, self.on_serving)
        # Told when a rank of an instance exits (exo_tasks.worker.ranks): ranks are not restarted.
        self.on_rank_exit: RankExitCallback = lambda handle, exitcode, cause: None
        self._settling: list[threading.Thread] = []  # on_rank_exit calls under way
        self.handles: dict[str, RunnerHandle] = {}
        self._lock = threading.RLock()
        self._closing = threading.Event()
        self._drain_deadline: float | None = None
        for model_path in settings.served_models:
            spec = runner_process.RunnerSpec.for_model(model_path, settings)
            self.handles[spec.runner_id] = RunnerHandle(spec)

    # --- starting and watching ---

    def start(self) -> None:
        for handle in self.handles.values():
            self._spawn(handle)
        threading.Thread(target=self._watch, name="runner-watch", daemon=True).start()
        threading.Thread(target=self._serve_requests, name="supervisor-inbox", daemon=True).start()

    def add_rank(self, spec: runner_process.RunnerSpec) -> None:
        """Start a rank of an instance: a runner like the others, for one start of it."""
        with self._lock:
            handle = self.handles[spec.runner_id] = RunnerHandle(spec)
            self._spawn(handle)

    @property
    def models(self) -> list[str]:
        return [h.spec.model for h in self.handles.values() if h.spec.rank is None]

    def _spawn(self, handle: RunnerHandle) -> None:
        spec = handle.spec.model_copy(update={"restarts": handle.restarts})
        # A new life: what its inbox holds was sent to the last one. A runner whose exit its
        # supervisor saw had it dropped then; one whose worker was SIGKILLed, not (a job handed
        # to it meanwhile, exo_tasks.direct, is requeued from that worker's heartbeat instead).
        self.store.runners.drop_inbox(spec.runner_id)
        self.store.runners.publish(
            lifecycle.spawned_runner(
                spec.runner_id, spec.host, spec.model, restarts=handle.restarts
            )
        )
        handle.progress = runner_process.RunnerProgress.create(_spawn)
        process = _spawn.Process(
            target=runner_main.main,
            args=(spec.model_dump_json(), handle.progress.array),
            name=f"runner {spec.runner_id}",
        )
        process.start()
        handle.process, handle.started_monotonic = process, time.monotonic()
        handle.stop = handle.stall = handle.restart_at = None
        log.info("runner started", extra={"runner": spec.runner_id, "pid": process.pid})

    def _watch(self) -> None:
        while not self._closing.is_set():
            try:
                self._watch_once()
            except Exception:  # Redis down, say: the watcher must outlive it
                log.exception("runner watch failed; retrying")
                time.sleep(WATCH_INTERVAL_S)

    def _watch_once(self) -> None:
        with self._lock:
            watched = {h.process.sentinel: h for h in self.handles.values() if h.process}
        ready = multiprocessing.connection.wait(list(watched), timeout=WATCH_INTERVAL_S)
        # Also poll: a pool child forked during a spawn can hold the sentinel pipe open.
        for sentinel, handle in watched.items():
            if sentinel in ready or self._exited(handle.process):
                self._on_exit(handle)
        self._restart_due()
        self._check_stalls()
        if self._drain_deadline is not None and time.monotonic() > self._drain_deadline:
            self._drain_deadline = None
            in_thread(self._stop_all, "hard")

    def _check_stalls(self) -> None:
        for runner_id, handle in list(self.handles.items()):
            if handle.progress is None or handle.stop is not None or handle.stall is not None:
                continue
            stall = handle.progress.stall(
                self.settings.prefill_timeout_s, self.settings.decode_timeout_s
            )
            if stall is not None and handle.process is not None:
                # A hung runner can finish nothing, warm or not: its jobs fail now, and it gets
                # no grace before SIGTERM (then SIGKILL).
                log.error(
                    "runner is hung; its threads' stacks follow, then it is stopped",
                    extra={"runner": runner_id, "why": stall, "pid": handle.process.pid},
                )
                handle.stall = stall
                # Its threads' stacks to the log (it shares the worker's), before the stop.
                self._signal(handle.process, runner_process.STACKS_SIGNAL)
                if handle.spec.rank is None:  # a rank's jobs fail with its instance's cause
                    self._fail_jobs_of_hung(runner_id, stall)
                in_thread(self.stop_runner, runner_id, StopRunner(mode="hard"), 0.0)

    def _fail_jobs_of_hung(self, runner_id: str, stall: str) -> None:
        """Fail a hung runner's jobs before its stop, so they carry the stall as their cause.
        Redis down must not spare it the stop: its exit fails them once Redis is back."""
        try:
            self.store.runners.fail_jobs(runner_id, f"runner {runner_id} failed: {stall}")
        except redis.RedisError as exc:
            log.warning(
                "hung runner's jobs not failed yet", extra={"runner": runner_id, "error": str(exc)}
            )

    def _on_exit(self, handle: RunnerHandle) -> None:
        with self._lock:
            process = handle.process
            if process is None:
                return
            # The sentinel fires as the process closes its files, before it can be reaped.
            process.join(REAP_WAIT_S)
            if process.exitcode is None:
                return
            if handle.spec.rank is not None:
                # Each start of a rank is a handle of its own: its instance decides what next.
                self.handles = {k: h for k, h in self.handles.items() if h is not handle}
                cause = exit_cause(process.exitcode)
                why = f"{handle.stall}; {cause}" if handle.stall else cause
                settle = in_thread(self.on_rank_exit, handle, process.exitcode, why)
                self._settling = [t for t in self._settling if t.is_alive()] + [settle]
            else:
                self.exits.record(handle, process.exitcode)
            # Only once recorded: if Redis was down, the next watch round records it again.
            handle.process = None

    def _restart_due(self) -> None:
        with self._lock:
            for handle in self.handles.values():
                if handle.restart_at is not None and time.monotonic() >= handle.restart_at:
                    handle.restarts += 1
                    self._spawn(handle)
                    restart = metrics.Observations()
                    restart.inc(metrics.RUNNER_RESTARTS, model=handle.spec.model, host=self.host)
                    self.store.metrics.write(restart)

    # --- requests from the shutdown_runner and load_runner tasks ---

    def _serve_requests(self) -> None:
        while not self._closing.is_set():
            try:
                request = self.store.hosts.next_supervisor_request(self.host, CONTROL_POLL_S)
            except Exception:
                log.exception("reading supervisor requests failed; retrying")
                time.sleep(CONTROL_POLL_S)
                continue
            if request is not None:
                in_thread(self.handle_request, request)

    def handle_request(self, request: SupervisorRequest) -> None:
        if request.runner_id not in self.handles:
            log.error(
                "request for a runner this host does not have", extra={"runner": request.runner_id}
            )
            return
        if isinstance(request, StopRunnerRequest):
            process = self.handles[request.runner_id].process
            pid = process.pid if process is not None else None
            if request.pid is not None and request.pid != pid:
                log.warning(
                    "stale shutdown ignored: the runner it was meant for is gone",
                    extra={"runner": request.runner_id, "meant_for_pid": request.pid, "pid": pid},
                )
                return
            grace = request.command.timeout_s + 1.0 if request.command.mode == "warm" else 1.0
            self.stop_runner(request.runner_id, request.command, grace, on_purpose=True)
        elif isinstance(request, StartRunnerRequest):
            self.start_runner(request.runner_id)

    def start_runner(self, runner_id: str) -> None:
        handle = self.handles[runner_id]
        process = handle.process
        state = self.store.runners.get(runner_id)
        unloaded = state is not None and state.status == RunnerStatus.UNLOADED
        # Unloaded, its process is on its way out: let it go, then start a new one.
        if process is not None and unloaded and self._wait_exit(process, TERM_WAIT_S):
            self._on_exit(handle)
        with self._lock:
            if handle.process is not None and handle.stop is None:
                log.info("runner already running", extra={"runner": runner_id})
                return
            handle.failures_in_a_row = 0
            self._spawn(handle)
        self.on_serving(handle.spec.model, True)

    # --- stopping ---

    def stop_runner(
        self, runner_id: str, command: StopRunner, grace_s: float, *, on_purpose: bool = False
    ) -> str:
        """Stop one runner by the escalation; returns the exit cause. `on_purpose`: an operator
        asked, so this host stops serving the model until it is loaded again."""
        with self._lock:
            handle = self.handles.get(runner_id)
            if handle is None:  # a rank that exited meanwhile: its handle went with it
                return "not running"
            process = handle.process
            if handle.stall is None:
                handle.stop = command
            handle.restart_at = None
        if on_purpose:
            self.on_serving(handle.spec.model, False)
        if process is None:
            last = self.store.runners.get(runner_id)
            self.exits.publish(handle, last, RunnerStatus.SHUTDOWN, None)
            return "not running"
        extra = {"runner": runner_id, "pid": process.pid}
        log.info("stopping runner", extra={**extra, "mode": command.mode, "grace_s": grace_s})
        self.store.runners.send(runner_id, command)
        if not self._wait_exit(process, grace_s):
            log.warning("runner did not stop within grace; sending SIGTERM", extra=extra)
            self._signal(process, signal.SIGTERM)
        if not self._wait_exit(process, TERM_WAIT_S):
            log.error("runner ignored SIGTERM; sending SIGKILL", extra=extra)
            self._signal(process, signal.SIGKILL)
        if not self._wait_exit(process, KILL_WAIT_S):
            log.critical("runner survived SIGKILL; resources may have leaked", extra=extra)
            return "still running"
        self._on_exit(handle)
        return exit_cause(process.exitcode)

    # Reaping (waitpid) happens only under the lock: two threads reaping one child would see a
    # running process that is already gone, and signal a pid that may have been reused.

    def _exited(self, process: BaseProcess | None) -> bool:
        with self._lock:
            return process is not None and process.exitcode is not None

    def _wait_exit(self, process: BaseProcess, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the process to exit, without reaping it unlocked."""
        deadline = time.monotonic() + timeout_s
        while not self._exited(process):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            multiprocessing.connection.wait([process.sentinel], min(remaining, WATCH_INTERVAL_S))
        return True

    def _signal(self, process: BaseProcess, signum: int) -> None:
        with self._lock:
            if process.exitcode is None and process.pid is not None:
                os.kill(process.pid, signum)

    def drain(self, window_s: float) -> None:
        """Warm worker shutdown has begun: in-flight jobs get `window_s` to finish; then the
        runners put what is left back on the queue, so the pool can drain and nothing is lost."""
        self._drain_deadline = time.monotonic() + window_s

    def stop(self) -> None:
        """The pool has drained. Within the drain window runners finish what they hold; past it
        (a cold shutdown whose tasks Celery cancelled gets no window) it goes back to the queue
        now: no task is waiting for those jobs any more."""
        deadline = self._drain_deadline
        self._stop_all("hard" if deadline is not None and time.monotonic() >= deadline else "warm")

    def terminate(self) -> None:
        """Cold shutdown: in-flight jobs go back to the queue now."""
        self._stop_all("hard")

    def _stop_all(self, mode: str) -> None:
        self._drain_deadline = None
        warm = mode == "warm"
        grace = self.settings.runner_shutdown_grace_s if warm else 1.0
        command = StopRunner(mode="warm" if warm else "hard", timeout_s=grace, requeue=True)
        threads = [
            in_thread(self.stop_runner, runner_id, command, grace + 1.0)
            for runner_id, handle in self.handles.items()
            if handle.process is not None
        ]
        for thread in threads:
            thread.join()
        # The worker exits after its ranks' exits are settled: a rank whose record still says
        # it runs would hold its instance short of Shutdown or Failed, with no one to move it.
        settled_by = time.monotonic() + SETTLE_WAIT_S
        for thread in list(self._settling):
            thread.join(max(0.0, settled_by - time.monotonic()))
        if warm or not any(h.process for h in self.handles.values()):
            self._closing.set()
            self.on_stopped()
