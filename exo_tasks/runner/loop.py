"""The runner's batching loop: the single owner of one loaded model on one host.

It loads the model once, warms it up, then serves every job handed to it through one
continuous-batching loop; what it owes Redis goes through its outbox. Commands arrive on its
Redis inbox (read by a thread into a local queue, so the loop never waits on the network). The
loop decides when: a bounded share of commands each round, a burst gathered, a step, a stop
(asked, or SIGTERM) and its deadline; the jobs themselves, joining and leaving the batch, are
`exo_tasks.runner.in_flight`'s. Its process (spec, entry point, exit codes) is
`exo_tasks.runner.process`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import queue
import time
from collections.abc import Callable

import redis

from exo_tasks import lifecycle
from exo_tasks.commands import CancelJob, CheckJobs, Restate, StopRunner, SubmitJob
from exo_tasks.fleet_types import RunnerStatus
from exo_tasks.runner import intake
from exo_tasks.runner.in_flight import InFlight
from exo_tasks.runner.keep_alive import KeepAlive
from exo_tasks.runner.outbox import Occupancy, Outbox
from exo_tasks.runner.process import (
    EXIT_CONFIG,
    EXIT_TERMINATED,
    EXIT_UNLOADED,
    ConfigError,
    Engine,
    RunnerProgress,
    RunnerSpec,
    load_engine,
)
from exo_tasks.store import Store, UnreadableCommand, redis_waits
from exo_tasks.types import JobStatus

log = logging.getLogger("exo_tasks.runner")
REDIS_RETRY_S = 0.5
IDLE_WAIT_S = 0.5
# Jobs that join a decoding batch come in bursts (jobs that started together end together, and
# their clients send the next ones), each a trip through the queue after the last. Before the
# next step the runner waits for the rest of a burst, while jobs keep coming (none for
# GATHER_GAP_S ends it), for at most GATHER_STEP_SHARE of a step or GATHER_MAX_S, until a
# prefill batch is full. The wait costs the batch little: the step already under way computes
# meanwhile. Without it a burst's first job is prefilled alone, decodes a step ahead of the
# rest, ends alone, its client's next job arrives alone, and so on for good.
GATHER_GAP_S = 0.05
GATHER_STEP_SHARE = 0.25
GATHER_MAX_S = 0.25
# The most time one round spends on commands before the batch steps: 150 prompts of 100k chars
# (70-120 ms each to tokenize) held the batch back 5 s and the stall watchdog killed the runner.
COMMANDS_BUDGET_S = 0.05


class Runner:
    def __init__(
        self,
        spec: RunnerSpec,
        progress: RunnerProgress,
        store: Store | None = None,
        engine_factory: Callable[[RunnerSpec], Engine] = load_engine,
    ) -> None:
        """`store`: the spec's own Redis unless given; `engine_factory` loads the model."""
        self.spec = spec
        self.progress = progress
        self.store = store or Store.from_url(spec.redis_url, job_ttl_s=spec.job_ttl_s)
        self.engine_factory = engine_factory
        self.outbox = Outbox(
            self.store, spec.first_state(), self._occupancy, progress.waiting_for_redis
        )
        self.commands: queue.Queue[intake.Command] = queue.Queue()
        self.keep_alive = KeepAlive(spec.idle_unload_s, jobs_decide=spec.rank is None)
        self.in_flight = InFlight(spec, self.store, self.outbox, progress, self.keep_alive)
        self.stop_request: StopRunner | None = None
        self.stop_deadline = 0.0
        self.serving = False
        self.terminate_requested = False
        self.step_s = 0.0  # how long the last generation step took

    def _occupancy(self) -> Occupancy:
        engine, state, active = self.in_flight.engine, self.outbox.state, self.in_flight.jobs
        if engine is None:  # unloaded: the largest batch it had stays, its cache went with it
            return Occupancy(len(active), state.largest_batch)
        used = (len(active), engine.largest_batch, engine.prompt_cache_bytes)
        return Occupancy(*used, *engine.memory)

    @property
    def stopping(self) -> bool:
        return self.stop_request is not None or self.terminate_requested

    # --- lifecycle ---

    def run(self) -> int:
        publish = self.outbox.publish
        publish(RunnerStatus.LOADING)
        try:
            self.load()
        except ConfigError as exc:
            log.error("runner cannot start", extra={"error": str(exc)})
            publish(RunnerStatus.FAILED, error=str(exc))
            return EXIT_CONFIG
        except Exception as exc:
            log.exception("model failed to load")
            publish(RunnerStatus.FAILED, error=f"model failed to load: {exc}")
            return 1
        screen = intake.Screen(self.in_flight.loaded.prompt_tokenizer, self.spec.max_prompt_tokens)
        intake.read_inbox(self.store, self.spec.runner_id, self.commands, screen)
        self.serving = True
        publish(RunnerStatus.READY)
        self.keep_alive.idle_from(time.monotonic())
        try:
            self.serve()
        except Exception as exc:
            log.exception("batching loop crashed")
            error = f"runner {self.spec.runner_id} crashed: {exc}"
            self.in_flight.end_all(JobStatus.FAILED, None, error)
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                self._flush()
            publish(RunnerStatus.FAILED, error=f"runner crashed: {exc}")
            return 1
        if self.stop_request is None:  # idle: the supervisor starts it again on demand
            self.outbox.amend(pid=None)
            publish(RunnerStatus.UNLOADED)
            self.unload()
            log.info("runner unloaded its idle model")
            return EXIT_UNLOADED
        self.unload()
        publish(RunnerStatus.SHUTDOWN)
        log.info("runner stopped cleanly")
        return 0

    def load(self) -> None:
        self.in_flight.engine = engine = self.engine_factory(self.spec)
        self.outbox.amend(
            model_loads=self.outbox.state.model_loads + 1,
            lanes=engine.lanes,
            tool_calling=engine.tool_calling,
            weights_bytes=engine.weights_bytes,
        )
        self.outbox.publish(RunnerStatus.LOADED)
        self.outbox.publish(RunnerStatus.WARMING_UP)
        engine.warmup()

    def unload(self) -> None:
        """Free the model: drop every reference, then let MLX release its buffers."""
        import mlx.core as mx

        self.in_flight.loaded.close()
        self.in_flight.engine = None
        gc.collect()
        mx.clear_cache()

    def on_sigterm(self) -> None:
        """The supervisor's second escalation step: stop now (only a flag: this is a handler)."""
        if not self.serving:
            raise SystemExit(EXIT_TERMINATED)
        self.terminate_requested = True

    # --- the batching loop ---

    def serve(self) -> None:
        while True:
            try:
                if self._serve_once():
                    return
            except redis.RedisError as exc:
                if not redis_waits(exc):
                    raise
                if self.terminate_requested:
                    # Told to stop now, with nowhere to write: waiting could last for ever (the
                    # worker would hang at exit joining us). Our jobs stay running under this
                    # worker's incarnation; the recovery loop requeues them once Redis is back
                    # and the worker's heartbeat is gone.
                    log.error("redis unreachable after SIGTERM; exiting without flushing")
                    raise SystemExit(EXIT_TERMINATED) from exc
                log.warning("redis unreachable or full; runner waits", extra={"error": str(exc)})
                # Waiting for Redis is not a hang: the supervisor's watchdog must not stop a
                # runner, and fail its jobs, for an outage that the jobs can outlast.
                self.in_flight.record_progress(progressed=True)
                time.sleep(REDIS_RETRY_S)

    def _serve_once(self) -> bool:
        """One round of the loop: commands, expiries, a step. True once a stop has finished, or
        once idle long enough to unload."""
        # Deliver what is owed to Redis first: after an outage the streams stay whole, in order.
        self._flush()
        active = self.in_flight.jobs
        decoding = len(active)
        self._take_commands(0.0 if decoding else IDLE_WAIT_S)
        if decoding and len(active) > decoding:
            self._gather_burst(decoding)
        if self.terminate_requested:
            requeue = self.stop_request is not None and self.stop_request.requeue
            self._begin_stop(StopRunner(mode="hard", requeue=requeue))
        self.in_flight.drop_expired()
        if self._finished():
            self._flush()
            return True
        if active:
            self._step()
        return False

    def _finished(self) -> bool:
        """A stop has finished, or the runner has been idle long enough to unload its model."""
        if self.stop_request is not None:
            return self._stop_finished()
        idle = not (self.in_flight.jobs or self.terminate_requested)
        return idle and self.keep_alive.due(time.monotonic())

    def _flush(self) -> None:
        self.outbox.flush(stopping=self.stop_request is not None)

    def _gather_burst(self, decoding: int) -> None:
        """Jobs just joined the `decoding` ones: take the rest of their burst before the next
        step. A lone job on an idle runner (one client, one job after another) is never held
        back."""
        deadline = time.monotonic() + min(GATHER_MAX_S, GATHER_STEP_SHARE * self.step_s)
        active = self.in_flight.jobs
        while len(active) - decoding < self.spec.prefill_batch_size and not self.stopping:
            wait_s = min(GATHER_GAP_S, deadline - time.monotonic())
            if wait_s <= 0 or not self._take_commands(wait_s):
                return

    def _take_commands(self, wait_s: float) -> bool:
        """Handle the commands in the inbox, waiting up to `wait_s` for the first one, until
        COMMANDS_BUDGET_S has passed: the rest wait for the next round, after a step."""
        get = self.commands.get
        try:
            command = get(timeout=wait_s) if wait_s > 0 else get(block=False)
        except queue.Empty:
            return False
        budget_end = time.monotonic() + COMMANDS_BUDGET_S
        while True:
            try:
                self._handle(command)
            except redis.RedisError as exc:
                if redis_waits(exc):
                    self.commands.put(command)  # handled again once Redis is back
                raise
            if time.monotonic() >= budget_end:
                return True
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, command: intake.Command) -> None:
        jobs = self.in_flight
        if isinstance(command, SubmitJob):
            if self.stop_request is None:
                jobs.admit(command)
            else:  # not started: back to the queue, never lost
                jobs.send_back(command.job.id)
        elif isinstance(command, intake.Refused):
            jobs.refuse(command.command, command.error, its_input=True)
        elif isinstance(command, CancelJob):
            jobs.end(command.job_id, lifecycle.cancel_status(command.reason), command.reason)
        elif isinstance(command, CheckJobs):
            jobs.check(command)
        elif isinstance(command, Restate):
            self.outbox.restate()
        elif isinstance(command, UnreadableCommand):
            jobs.unreadable(command)
        else:
            self._begin_stop(command)

    def _step(self) -> None:
        self.step_s = self.in_flight.step()
        self._flush()

    # --- stopping ---

    def _begin_stop(self, command: StopRunner) -> None:
        """Start stopping, or make a stop under way stricter (sooner, or requeueing)."""
        under_way = (self.stop_request, self.stop_deadline)
        stop, deadline = command.after(*under_way, now=time.monotonic())
        if (stop, deadline) == under_way:
            return
        log.info("stop requested", extra=stop.model_dump(exclude={"kind"}))
        self.stop_request, self.stop_deadline = stop, deadline
        self.outbox.publish(RunnerStatus.SHUTTING_DOWN)

    def _stop_finished(self) -> bool:
        """Wait for in-flight jobs until the deadline; then requeue or end the rest."""
        if self.in_flight.jobs and time.monotonic() < self.stop_deadline:
            return False
        assert self.stop_request is not None
        if self.stop_request.requeue:
            self.in_flight.requeue_all()
        else:
            self.in_flight.end_all(
                JobStatus.FAILED,
                "shutdown",
                f"runner {self.spec.runner_id} shut down before the job finished",
            )
        return True
