"""The runner's batching loop: the single owner of one loaded model on one host.

It loads the model once, warms it up, then serves every job handed to it through one
continuous-batching loop; what it owes Redis goes through its outbox. Commands arrive on its
Redis inbox (read by a thread into a local queue, so the loop never waits on the network). Its
process (spec, entry point, exit codes) is `exo_tasks.runner.process`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import queue
import time
from collections.abc import Callable

import redis

from exo_tasks import lifecycle, metrics
from exo_tasks.commands import CancelJob, StopRunner, SubmitJob
from exo_tasks.fleet_types import RunnerStatus
from exo_tasks.runner import intake
from exo_tasks.runner.active_job import ActiveJob, take_step
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
from exo_tasks.types import FinishReason, JobStatus, utcnow

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
        self.engine: Engine | None = None
        self.outbox = Outbox(self.store, spec.first_state(), self._occupancy)
        self.commands: queue.Queue[intake.Command] = queue.Queue()
        self.active: dict[str, ActiveJob] = {}
        self.stop_request: StopRunner | None = None
        self.stop_deadline = 0.0
        self.serving = False
        self.terminate_requested = False
        self.step_s = 0.0  # how long the last generation step took
        self.keep_alive = KeepAlive(spec.idle_unload_s, jobs_decide=spec.rank is None)

    @property
    def loaded(self) -> Engine:
        """The engine, once load() has built it (the loop runs only then)."""
        assert self.engine is not None, "the runner's model is not loaded"
        return self.engine

    def _occupancy(self) -> Occupancy:
        engine, state = self.engine, self.outbox.state
        if engine is None:  # unloaded: the largest batch it had stays, its cache went with it
            return Occupancy(len(self.active), state.largest_batch)
        used = (len(self.active), engine.largest_batch, engine.prompt_cache_bytes)
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
        screen = intake.Screen(self.loaded.prompt_tokenizer, self.spec.max_prompt_tokens)
        intake.read_inbox(self.store, self.spec.runner_id, self.commands, screen)
        self.serving = True
        publish(RunnerStatus.READY)
        self.keep_alive.idle_from(time.monotonic())
        try:
            self.serve()
        except Exception as exc:
            log.exception("batching loop crashed")
            self._end_all(JobStatus.FAILED, None, f"runner {self.spec.runner_id} crashed: {exc}")
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
        self.engine = engine = self.engine_factory(self.spec)
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

        self.loaded.close()
        self.engine = None
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
                time.sleep(REDIS_RETRY_S)

    def _serve_once(self) -> bool:
        """One round of the loop: commands, expiries, a step. True once a stop has finished, or
        once idle long enough to unload."""
        # Deliver what is owed to Redis first: after an outage the streams stay whole, in order.
        self._flush()
        decoding = len(self.active)
        self._take_commands(0.0 if decoding else IDLE_WAIT_S)
        if decoding and len(self.active) > decoding:
            self._gather_burst(decoding)
        if self.terminate_requested:
            requeue = self.stop_request is not None and self.stop_request.requeue
            self._begin_stop(StopRunner(mode="hard", requeue=requeue))
        self._drop_expired()
        if self._finished():
            self._flush()
            return True
        if self.active:
            self._step()
        return False

    def _finished(self) -> bool:
        """A stop has finished, or the runner has been idle long enough to unload its model."""
        if self.stop_request is not None:
            return self._stop_finished()
        idle = not (self.active or self.terminate_requested)
        return idle and self.keep_alive.due(time.monotonic())

    def _flush(self) -> None:
        self.outbox.flush(stopping=self.stop_request is not None)

    def _gather_burst(self, decoding: int) -> None:
        """Jobs just joined the `decoding` ones: take the rest of their burst before the next
        step. A lone job on an idle runner (one client, one job after another) is never held
        back."""
        deadline = time.monotonic() + min(GATHER_MAX_S, GATHER_STEP_SHARE * self.step_s)
        while len(self.active) - decoding < self.spec.prefill_batch_size and not self.stopping:
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
        if isinstance(command, SubmitJob):
            self._admit(command)
        elif isinstance(command, intake.Refused):
            self._refuse(command.command, command.error)
        elif isinstance(command, CancelJob):
            self._end(command.job_id, lifecycle.cancel_status(command.reason), command.reason)
        elif isinstance(command, UnreadableCommand):
            self._unreadable(command)
        else:
            self._begin_stop(command)

    def _unreadable(self, command: UnreadableCommand) -> None:
        """A message we cannot read fails the job it names now: dropped, the job would show
        `running` until its time limits, which the message may have been unreadable for."""
        log.error("unreadable command in the inbox", extra={"job_id": command.job_id})
        if command.job_id is None:
            return
        error = f"the runner could not read the job's command: {command.error}"
        if command.job_id in self.active:
            self._end(command.job_id, JobStatus.FAILED, None, error)
        else:  # never joined the batch, and we do not have its record
            self.store.runners.release_job(self.spec.runner_id, command.job_id)
            self.store.jobs.fail(command.job_id, error)
            self._record_progress(progressed=True)

    def _refuse(self, command: SubmitJob, error: str) -> None:
        """Fail a job that cannot join the batch: written with the next step's writes, and work
        done for the stall watchdog."""
        self.outbox.endings.append(intake.refusal(command.job, error))
        self._record_progress(progressed=True)

    def _admit(self, command: SubmitJob) -> None:
        # Its task marked the job running as it handed it over: nothing to write to start it.
        job = command.job
        if self.stop_request is not None:  # not started: back to the queue, never lost
            self.store.runners.release_job(self.spec.runner_id, job.id)
            self.store.jobs.requeue(job.id)
            return
        try:
            prompt = intake.prompt_tokens_of(self.loaded, job.request, self.spec.max_prompt_tokens)
            self.loaded.add(job.id, prompt, job.request)
        except ValueError as exc:  # the prompt's refusal, or the engine's own checks
            self._refuse(command, str(exc))
            return
        except Exception as exc:
            # Whatever else one job's input can raise (such as MLX refusing its seed) is that
            # job's failure, never the batching loop's.
            log.exception("job could not be admitted", extra={"job_id": job.id})
            self._refuse(command, f"could not start the job: {type(exc).__name__}: {exc}")
            return
        # Counted here; the stored record shows it once the job ends.
        usage = job.usage.model_copy(update={"prompt_tokens": len(prompt)})
        started = job.model_copy(update={"usage": usage})
        limits = (command.soft_deadline, command.deadline, self.spec.max_job_bytes)
        self.active[job.id] = ActiveJob(started, *limits)
        self.outbox.observe(metrics.QUEUE_TIME, utcnow() - job.created_at)
        self._record_progress(progressed=True)
        log.info("job admitted", extra={"job_id": job.id, "prompt_tokens": len(prompt)})
        self.outbox.jobs_changed()

    def _step(self) -> None:
        started = time.monotonic()
        deltas = self.loaded.step()
        self.step_s = time.monotonic() - started
        for job_id, ending in take_step(self.active, deltas, self.outbox):
            self._end(job_id, *ending, in_engine=False)
        # A chunk of a long prompt prefilled is progress too: a runner busy prefilling is not hung.
        self._record_progress(progressed=bool(deltas) or self.loaded.prefill_chunks > 0)
        self._flush()

    def _record_progress(self, *, progressed: bool) -> None:
        awaiting = sum(job.awaiting_first_token for job in self.active.values())
        self.progress.record(
            active=len(self.active), awaiting_first_token=awaiting, progressed=progressed
        )

    def _end(
        self,
        job_id: str,
        status: JobStatus | str,
        reason: FinishReason | None,
        error: str | None = None,
        *,
        in_engine: bool = True,
    ) -> None:
        """Take a job out of the batch and record how it ended (first writer wins). `status`:
        an ending (lifecycle.ENDINGS), by member or value."""
        job = self.active.pop(job_id, None)
        if job is None:
            return
        if in_engine:
            self.loaded.remove(job_id)
        self.outbox.endings.append(job.ended(JobStatus(status), reason, error))
        self.keep_alive.idle_from(time.monotonic(), job.record.request.keep_alive)
        log.info("job ended", extra={"job_id": job_id, "status": status, "finish_reason": reason})
        self._after_job_left()

    def _after_job_left(self) -> None:
        self._record_progress(progressed=False)
        self.outbox.jobs_changed()

    def _end_all(self, status: JobStatus, reason: FinishReason | None, error: str | None) -> None:
        for job_id in list(self.active):
            self._end(job_id, status, reason, error)

    def _requeue_all(self) -> None:
        """The worker is stopping: unfinished jobs go back to the queue for another attempt."""
        for job_id in list(self.active):
            del self.active[job_id]
            self.loaded.remove(job_id)
            self.store.jobs.requeue(job_id)
            self.store.runners.release_job(self.spec.runner_id, job_id)
            log.info("job requeued", extra={"job_id": job_id})
        self._after_job_left()

    def _drop_expired(self) -> None:
        """End the jobs past their time limits by our own clock (the task's hard limit kills
        its pool child before it can tell us; the soft limit's signal can be lost), or past
        their storage bound."""
        now = time.time()
        for job_id, job in list(self.active.items()):
            ending = job.expiry(now) or job.over_storage()
            if ending is not None:
                self._end(job_id, *ending)

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
        if self.active and time.monotonic() < self.stop_deadline:
            return False
        assert self.stop_request is not None
        if self.stop_request.requeue:
            self._requeue_all()
        else:
            self._end_all(
                JobStatus.FAILED,
                "shutdown",
                f"runner {self.spec.runner_id} shut down before the job finished",
            )
        return True
