"""The runner process: the single owner of one loaded model on one host.

It loads the model once, warms it up, then serves every job handed to it through one
continuous-batching loop, publishing tokens and job results to Redis. Commands arrive on its
Redis inbox (read by a thread into a local queue, so the loop never waits on the network).
It exits when its parent (the worker's main process) dies.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis
from pydantic import BaseModel

from exo_tasks import lifecycle, metrics
from exo_tasks.commands import CancelJob, RunnerCommand, StopRunner, SubmitJob
from exo_tasks.logs import configure_logging
from exo_tasks.store import Store, UnreadableCommand, is_out_of_memory
from exo_tasks.types import (
    FinishReason,
    JobRecord,
    JobStatus,
    RunnerState,
    RunnerStatus,
    TokenEvent,
    utcnow,
)
from exo_tasks.wire import TokenLogprob, ToolCall

if TYPE_CHECKING:  # the engine imports MLX, which only load() needs
    from exo_tasks.engine import TokenDelta

log = logging.getLogger("exo_tasks.runner")
INBOX_POLL_S = 1.0
REDIS_RETRY_S = 0.5
IDLE_WAIT_S = 0.5
STATE_DELAY_S = 0.05
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
# Exit code of a runner that cannot work as configured: the supervisor does not restart it.
EXIT_CONFIG = 78  # EX_CONFIG


class ConfigError(Exception):
    """The runner's configuration is wrong: restarting it would fail the same way."""


def check_model_path(model_path: str) -> None:
    """A model given as a local path must exist; anything else is a hub id for mlx_lm."""
    path = Path(model_path).expanduser()
    local = (
        path.is_absolute()
        or model_path.startswith(("./", "../", "~"))
        or (len(path.parts) > 1 and path.parent.is_dir())
    )
    if local and not path.exists():
        raise ConfigError(f"model path '{model_path}' does not exist")


def redis_waits(exc: redis.RedisError) -> bool:
    """Redis is unreachable, or full (it refuses writes until keys expire): the runner keeps
    what it owes Redis and tries again, rather than failing its jobs."""
    return isinstance(exc, redis.ConnectionError | redis.TimeoutError) or is_out_of_memory(exc)


class RunnerSpec(BaseModel):
    """Everything a runner process needs, handed over by the supervisor at spawn."""

    runner_id: str
    host: str
    model: str
    model_path: str
    redis_url: str
    job_ttl_s: int
    max_prompt_tokens: int
    restarts: int = 0
    completion_batch_size: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = 256
    lanes: int | None = None  # None: the engine's default for the device
    log_level: str = "INFO"


class RunnerProgress:
    """Shared memory with the supervisor, so it can tell a hung runner from a busy one:
    [time of the last progress (monotonic), active jobs, jobs still waiting for a first token]."""

    def __init__(self, array: Any) -> None:
        self.array = array

    @classmethod
    def create(cls, context: Any) -> RunnerProgress:
        # No lock: a runner SIGKILLed while holding it would leave the supervisor blocked.
        return cls(context.Array("d", 3, lock=False))

    def record(self, *, active: int, awaiting_first_token: int, progressed: bool) -> None:
        if progressed:
            self.array[0] = time.monotonic()
        self.array[1], self.array[2] = active, awaiting_first_token

    def stall(self, prefill_timeout_s: float, decode_timeout_s: float) -> str | None:
        """Why the runner counts as hung, or None. Idle is never a stall."""
        last, active, awaiting = self.array[0], self.array[1], self.array[2]
        if active == 0:
            return None
        silent_s = time.monotonic() - last
        if awaiting and silent_s > prefill_timeout_s:
            return f"stalled in prefill (no first token for {silent_s:.1f}s)"
        if not awaiting and silent_s > decode_timeout_s:
            return f"stalled in decode (no token for {silent_s:.1f}s)"
        return None


@dataclass
class ActiveJob:
    record: JobRecord
    soft_deadline: float
    deadline: float
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    last_token_at: datetime | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)


def main(spec_json: str, progress_array: Any) -> None:
    """Entry point of the spawned runner process."""
    spec = RunnerSpec.model_validate_json(spec_json)
    # Our own process group: a signal sent to the worker's group (honcho, a terminal's Ctrl-C)
    # must not reach the runner; the supervisor decides when it stops.
    os.setpgid(0, 0)
    configure_logging(spec.log_level, runner=spec.runner_id, host=spec.host)
    _exit_with_parent()
    runner = Runner(spec, RunnerProgress(progress_array))
    signal.signal(signal.SIGTERM, lambda *_: runner.on_sigterm())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(runner.run())


def _exit_with_parent() -> None:
    """Leave at once if the worker dies (SIGKILL included), so no model stays resident."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        log.error("worker process %s is gone; runner exits", parent.pid)
        os._exit(70)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class Runner:
    def __init__(
        self, spec: RunnerSpec, progress: RunnerProgress, store: Store | None = None
    ) -> None:
        """`store`: the spec's own Redis unless given (a unit test's)."""
        self.spec = spec
        self.progress = progress
        self.store = store or Store.from_url(spec.redis_url, job_ttl_s=spec.job_ttl_s)
        self.state = RunnerState(
            id=spec.runner_id,
            host=spec.host,
            model=spec.model,
            status=RunnerStatus.WAITING_FOR_MODEL,
            pid=os.getpid(),
            started_at=utcnow(),
            restarts=spec.restarts,
        )
        self.commands: queue.Queue[RunnerCommand | UnreadableCommand] = queue.Queue()
        self.active: dict[str, ActiveJob] = {}
        self.stop_request: StopRunner | None = None
        self.stop_deadline = 0.0
        self.serving = False
        self.terminate_requested = False
        self.unsent_tokens: list[tuple[str, TokenEvent]] = []
        self.observations = metrics.Observations()  # sent with the tokens
        self.unsent_endings: list[JobRecord] = []
        self.state_unpublished = False
        self.state_due: float | None = None  # when the jobs' comings and goings get published
        self.step_s = 0.0  # how long the last generation step took

    # --- status ---

    def publish(self, status: RunnerStatus | None = None, error: str | None = None) -> None:
        changed = status is not None and status != self.state.status
        update: dict[str, Any] = {"updated_at": utcnow(), "active_jobs": len(self.active)}
        if status is not None:
            update.update(status=status, error=error)
        if hasattr(self, "engine"):
            update["largest_batch"] = self.engine.largest_batch
        self.state = self.state.model_copy(update=update)
        try:
            self.store.publish_runner(self.state, status_changed=changed)
            self.state_unpublished = False
        except (redis.ConnectionError, redis.TimeoutError):
            self.state_unpublished = True  # published again once Redis is back
        if changed:
            log.info("runner status %s", self.state.status, extra={"runner_status": status})

    # --- lifecycle ---

    def run(self) -> int:
        self.publish(RunnerStatus.LOADING)
        try:
            self.load()
        except ConfigError as exc:
            log.error("runner cannot start", extra={"error": str(exc)})
            self.publish(RunnerStatus.FAILED, error=str(exc))
            return EXIT_CONFIG
        except Exception as exc:
            log.exception("model failed to load")
            self.publish(RunnerStatus.FAILED, error=f"model failed to load: {exc}")
            return 1
        threading.Thread(target=self._read_inbox, name="inbox", daemon=True).start()
        self.serving = True
        self.publish(RunnerStatus.READY)
        try:
            self.serve()
        except Exception as exc:
            log.exception("batching loop crashed")
            self._end_all(JobStatus.FAILED, None, f"runner {self.spec.runner_id} crashed: {exc}")
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                self._flush()
            self.publish(RunnerStatus.FAILED, error=f"runner crashed: {exc}")
            return 1
        self.unload()
        self.publish(RunnerStatus.SHUTDOWN)
        log.info("runner stopped cleanly")
        return 0

    def load(self) -> None:
        import mlx_lm

        from exo_tasks.engine import BatchEngine

        check_model_path(self.spec.model_path)
        loaded = mlx_lm.load(self.spec.model_path)
        model, tokenizer = loaded[0], loaded[1]
        self.state = self.state.model_copy(update={"model_loads": self.state.model_loads + 1})
        self.publish(RunnerStatus.LOADED)
        self.engine = BatchEngine(
            model,
            tokenizer,
            completion_batch_size=self.spec.completion_batch_size,
            prefill_batch_size=self.spec.prefill_batch_size,
            prefill_step_size=self.spec.prefill_step_size,
            lanes=self.spec.lanes,
        )
        self.state = self.state.model_copy(
            update={"lanes": self.engine.lanes, "tool_calling": self.engine.tool_calling}
        )
        self.publish(RunnerStatus.WARMING_UP)
        self.engine.warmup()

    def unload(self) -> None:
        """Free the model: drop every reference, then let MLX release its buffers."""
        import mlx.core as mx

        self.engine.close()
        del self.engine
        gc.collect()
        mx.clear_cache()

    def on_sigterm(self) -> None:
        """The supervisor's second escalation step: stop now (only a flag: this is a handler)."""
        if not self.serving:
            raise SystemExit(143)
        self.terminate_requested = True

    def _read_inbox(self) -> None:
        while True:
            try:
                command = self.store.next_runner_command(self.spec.runner_id, INBOX_POLL_S)
            except Exception:
                log.exception("reading the inbox failed; retrying")
                time.sleep(INBOX_POLL_S)
                continue
            if command is not None:
                self.commands.put(command)

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
                    raise SystemExit(143) from exc
                log.warning("redis unreachable or full; runner waits", extra={"error": str(exc)})
                time.sleep(REDIS_RETRY_S)

    def _serve_once(self) -> bool:
        """One round of the loop: commands, expiries, a step. True once a stop has finished."""
        # Deliver what is owed to Redis before generating more: after an outage the streams
        # stay complete and in order.
        self._flush()
        decoding = len(self.active)
        self._take_commands(0.0 if decoding else IDLE_WAIT_S)
        if decoding and len(self.active) > decoding:
            self._gather_burst(decoding)
        if self.terminate_requested:
            requeue = self.stop_request is not None and self.stop_request.requeue
            self._begin_stop(StopRunner(mode="hard", requeue=requeue))
        self._drop_expired()
        if self.stop_request is not None and self._stop_finished():
            self._flush()
            return True
        if self.active:
            self._step()
        return False

    def _flush(self) -> None:
        """Send the tokens and job endings not yet in Redis (kept here while it is down), with
        the metrics observed since the last flush; then the runner's state if jobs came or
        went."""
        wrote = bool(self.unsent_tokens or self.unsent_endings)
        if wrote:
            self.store.write_step(
                self.spec.runner_id, self.unsent_tokens, self.observations, self.unsent_endings
            )
            self.unsent_tokens, self.unsent_endings = [], []
        due = self.state_due is not None and (wrote or time.monotonic() >= self.state_due)
        if due or self.state_unpublished:
            self._publish_jobs()

    def _jobs_changed(self) -> None:
        """Publish Running/Ready and active_jobs with the next tokens or endings, after them (the
        client waiting on them does not wait for this write too), or after STATE_DELAY_S: a job
        that starts and ends in between costs no write at all."""
        if self.state_due is None:
            self.state_due = time.monotonic() + STATE_DELAY_S

    def _publish_jobs(self) -> None:
        self.state_due = None
        status = self.state.status
        if self.stop_request is None:
            status = RunnerStatus.RUNNING if self.active else RunnerStatus.READY
        unchanged = (
            status == self.state.status
            and len(self.active) == self.state.active_jobs
            and self.engine.largest_batch == self.state.largest_batch
        )
        if not unchanged or self.state_unpublished:
            self.publish(status)

    @property
    def stopping(self) -> bool:
        return self.stop_request is not None or self.terminate_requested

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
        """Handle every command in the inbox, waiting up to `wait_s` for the first one."""
        get = self.commands.get
        try:
            command = get(timeout=wait_s) if wait_s > 0 else get(block=False)
        except queue.Empty:
            return False
        while True:
            try:
                self._handle(command)
            except redis.RedisError as exc:
                if redis_waits(exc):
                    self.commands.put(command)  # handled again once Redis is back
                raise
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, command: RunnerCommand | UnreadableCommand) -> None:
        if isinstance(command, SubmitJob):
            self._admit(command)
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
            self._end(command.job_id, "failed", None, error)
        else:
            self._refuse(command.job_id, error)

    def _refuse(self, job_id: str, error: str) -> None:
        """Fail a job that never joined the batch."""
        self.store.release_job(self.spec.runner_id, job_id)
        self.store.fail_job(job_id, error)

    def _admit(self, command: SubmitJob) -> None:
        # Its task marked the job running as it handed it over: nothing to write to start it.
        job = command.job
        if self.stop_request is not None:  # not started: back to the queue, never lost
            self.store.release_job(self.spec.runner_id, job.id)
            self.store.requeue_job(job.id)
            return
        try:
            request = job.request
            prompt_tokens = self.engine.encode(request.prompt, request.messages, request.tools)
        except Exception as exc:  # noqa: BLE001 (any tokenizer or template error is the job's)
            self._refuse(job.id, f"could not encode the prompt: {exc}")
            return
        cap = self.spec.max_prompt_tokens
        if len(prompt_tokens) > cap:
            self._refuse(
                job.id,
                f"the prompt is {len(prompt_tokens)} tokens after the chat template; "
                f"at most {cap} (EXO_MAX_PROMPT_TOKENS)",
            )
            return
        # Counted here; the stored record shows it once the job ends.
        usage = job.usage.model_copy(update={"prompt_tokens": len(prompt_tokens)})
        started = job.model_copy(update={"usage": usage})
        try:
            self.engine.add(job.id, prompt_tokens, job.request)
        except ValueError as exc:  # the engine's own checks
            self._refuse(job.id, str(exc))
            return
        except Exception as exc:
            # Whatever else one job's input can raise (such as MLX refusing its seed) is that
            # job's failure, never the batching loop's.
            log.exception("job could not be admitted", extra={"job_id": job.id})
            self._refuse(job.id, f"could not start the job: {type(exc).__name__}: {exc}")
            return
        self.active[job.id] = ActiveJob(started, command.soft_deadline, command.deadline)
        self._observe(metrics.QUEUE_TIME, utcnow() - job.created_at)
        self._record_progress(progressed=True)
        log.info("job admitted", extra={"job_id": job.id, "prompt_tokens": len(prompt_tokens)})
        self._jobs_changed()

    def _step(self) -> None:
        started = time.monotonic()
        deltas = self.engine.step()
        self.step_s = time.monotonic() - started
        tokens: list[tuple[str, TokenEvent]] = []
        finished: list[tuple[str, FinishReason]] = []
        failed: list[tuple[str, str]] = []
        now = utcnow()
        for delta in deltas:
            job = self.active.get(delta.job_id)
            if job is None:
                continue
            if delta.error is not None:  # the engine took the job out: its step failed
                failed.append((delta.job_id, delta.error))
                continue
            token = self._take_token(job, delta, now)
            if token is not None:
                tokens.append((delta.job_id, token))
            if delta.finish_reason is not None:
                finished.append((delta.job_id, delta.finish_reason))
        self.unsent_tokens.extend(tokens)
        for job_id, reason in finished:
            self._end(job_id, "succeeded", reason, in_engine=False)
        for job_id, error in failed:
            self._end(job_id, "failed", None, error, in_engine=False)
        # A chunk of a long prompt prefilled is progress too: a runner busy prefilling is not hung.
        self._record_progress(progressed=bool(deltas) or self.engine.prefill_chunks > 0)
        self._flush()

    def _take_token(self, job: ActiveJob, delta: TokenDelta, now: datetime) -> TokenEvent | None:
        """Count a job's step (its latency metrics too); the event for its new text, if any."""
        if job.record.first_token_at is None:
            job.record.first_token_at = now
            self._observe(metrics.TIME_TO_FIRST_TOKEN, now - job.record.created_at)
        elif job.last_token_at is not None and delta.completion_tokens > job.completion_tokens:
            new = delta.completion_tokens - job.completion_tokens
            self._observe(metrics.INTER_TOKEN_LATENCY, (now - job.last_token_at) / new, new)
        job.last_token_at = now
        job.completion_tokens = delta.completion_tokens
        job.logprobs += delta.logprobs
        job.tool_calls += delta.tool_calls
        if not (delta.text or delta.logprobs or delta.tool_calls):
            return None
        job.text.append(delta.text)
        return delta.event(len(job.text) - 1)

    def _observe(self, metric: metrics.Metric, elapsed: timedelta, count: int = 1) -> None:
        self.observations.observe(metric, elapsed.total_seconds(), count, model=self.spec.model)

    def _record_progress(self, *, progressed: bool) -> None:
        awaiting = sum(1 for job in self.active.values() if job.record.first_token_at is None)
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
            self.engine.remove(job_id)
        final = job.record.ended(
            JobStatus(status),
            text="".join(job.text),
            finish_reason=reason,
            completion_tokens=job.completion_tokens,
            error=error,
            logprobs=job.logprobs,
            tool_calls=job.tool_calls,
        )
        self.unsent_endings.append(final)
        log.info("job ended", extra={"job_id": job_id, "status": status, "finish_reason": reason})
        self._after_job_left()

    def _after_job_left(self) -> None:
        self._record_progress(progressed=False)
        self._jobs_changed()

    def _end_all(self, status: JobStatus, reason: FinishReason | None, error: str | None) -> None:
        for job_id in list(self.active):
            self._end(job_id, status, reason, error)

    def _requeue_all(self) -> None:
        """The worker is stopping: unfinished jobs go back to the queue for another attempt."""
        for job_id in list(self.active):
            del self.active[job_id]
            self.engine.remove(job_id)
            self.store.requeue_job(job_id)
            self.store.release_job(self.spec.runner_id, job_id)
            log.info("job requeued", extra={"job_id": job_id})
        self._after_job_left()

    def _drop_expired(self) -> None:
        """End the jobs past their time limits by our own clock. The task's hard limit kills its
        pool child before it can tell us, and the signal that brings the soft limit to the task
        can be lost (seen: a limit logged by the worker, never raised in the child)."""
        now = time.time()
        for job_id, job in list(self.active.items()):
            if now > job.deadline:
                self._end(job_id, JobStatus.FAILED, "time_limit", "hard time limit exceeded")
            elif now > job.soft_deadline:
                self._end(job_id, JobStatus.TIMED_OUT, "time_limit")

    # --- stopping ---

    def _begin_stop(self, command: StopRunner) -> None:
        """Start stopping, or make a stop under way stricter (sooner, or requeueing)."""
        deadline = time.monotonic() + (0 if command.mode == "hard" else command.timeout_s)
        if self.stop_request is not None:
            deadline = min(deadline, self.stop_deadline)
            command = command.model_copy(
                update={"requeue": command.requeue or self.stop_request.requeue}
            )
            if command == self.stop_request and deadline == self.stop_deadline:
                return
        log.info("stop requested", extra=command.model_dump(exclude={"kind"}))
        self.stop_request, self.stop_deadline = command, deadline
        self.publish(RunnerStatus.SHUTTING_DOWN)

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
