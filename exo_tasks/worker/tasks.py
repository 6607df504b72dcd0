"""Celery tasks, run in the worker's pool children. They never import MLX: they hand work to
the host's runner (or its supervisor) through Redis and wait, in short slices so that Celery's
soft time limit (a signal) is delivered promptly."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import redis
from billiard.einfo import ExceptionInfo
from celery import Task, shared_task
from celery.exceptions import Reject, SoftTimeLimitExceeded, TimeLimitExceeded
from celery.signals import task_failure

from exo_tasks import jobs, lifecycle, limits
from exo_tasks.celery_app import (
    INFERENCE_TASK,
    exo_app,
)
from exo_tasks.commands import (
    CancelJob,
    StartRunnerRequest,
    SubmitJob,
)
from exo_tasks.errors import ExoError, RunnerGone
from exo_tasks.fleet_types import RunnerState, RunnerStatus
from exo_tasks.naming import (
    host_of_queue,
    instance_of_queue,
    instance_runner_id,
    runner_id_for,
)
from exo_tasks.recovery import HEARTBEAT_INTERVAL_S
from exo_tasks.store import Store
from exo_tasks.types import JobEnding, JobRecord, JobStatus, RequeuedEvent
from exo_tasks.worker import soft_limit, task_states

log = logging.getLogger("exo_tasks.tasks")
# The wait for a job's ending is cut into slices, to check on its runner and report progress.
WAIT_SLICE_MS = 1000
# After a soft time limit the runner ends the job at its next step; this bounds our wait.
CANCEL_ACK_S = 3.0
REDIS_RETRY_S = 0.5
# A job's holder with no heartbeat at all may have lost Redis for longer than the heartbeat's
# TTL: its kombu gives back the messages it held as it reconnects, and one may reach this worker
# before that worker beats again. It is given two beats to show it lives.
OWNER_BEAT_WAIT_S = 2 * HEARTBEAT_INTERVAL_S
OWNER_BEAT_POLL_S = 0.2
PINNED_REQUEUE_PAUSE_S = 1.0


class InferenceTask(Task):  # type: ignore[type-arg]
    # A job that failed or timed out is the task's FAILURE, expected: logged without a traceback.
    throws = (task_states.JobEnded,)

    def on_failure(
        self, exc: Exception, task_id: str, args: Any, kwargs: Any, einfo: ExceptionInfo
    ) -> None:
        # A hard time limit kills the pool child; Celery then calls this in the main process.
        if isinstance(exc, TimeLimitExceeded):
            app = exo_app(self)
            job = app.store.jobs.get(task_id)
            app.store.jobs.fail(task_id, f"hard time limit exceeded ({exc.args[0]}s)")
            if job is not None and job.runner_id is not None:
                app.store.runners.send(job.runner_id, CancelJob(job_id=task_id))


@task_failure.connect
def _time_out_a_task_cut_before_its_body(
    sender: Task[Any, Any] | None = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    **_: Any,
) -> None:
    """A soft limit that fired before the task's body could catch it (a very short
    `timeout_s`) fails the task, and its message is acked: end the job, or it stays queued for
    good. This signal is the one place that sees every such case: Celery sends it from the pool
    child when the limit cut its tracer, and from the worker's main process (calling no
    on_failure at all) when it cut the message's decoding, as
    DecodeError(SoftTimeLimitExceeded())."""
    if sender is None or sender.name != INFERENCE_TASK or task_id is None:
        return
    causes = [exception, *getattr(exception, "args", ())]
    if any(isinstance(cause, SoftTimeLimitExceeded) for cause in causes):
        _time_out(exo_app(sender).store, task_id)


@dataclass(frozen=True)
class Prepared:
    """A delivered job to run: its record and its runner's state, as read together;
    `handed_over`: the job is on its runner already (exo_tasks.direct), to be followed."""

    job: JobRecord
    runner: RunnerState | None
    handed_over: bool = False


@dataclass(frozen=True)
class Skipped:
    """A delivered job not to run (unknown, ended, or running on a live worker)."""

    job: JobRecord | None


@dataclass(frozen=True)
class Attempt:
    """A job handed to `runner`: its ending is the first after stream position `after`, its
    tokens the events after the first `events_before`."""

    runner: RunnerState
    after: str
    events_before: int


# STARTED is stored by the task's first check on its job (task_states.TaskProgress), not before
# the hand-over: the write (a GET, a SET and a PUBLISH) would sit between every job's delivery
# and its hand-over.
@shared_task(name=INFERENCE_TASK, bind=True, base=InferenceTask, track_started=False)
def inference(self: Task[Any, Any], job_id: str, model: str) -> dict[str, Any]:
    """Run one job on this host's runner for `model`: prepare, hand over, follow. The job
    record holds the result; the task ends as the job did (task_states.finish)."""
    app = exo_app(self)
    store = app.store
    runner_id = _runner_for(self, model, app.settings.hostname)
    extra = {"job_id": job_id, "runner": runner_id}
    prepared: Prepared | Skipped | None = None
    attempt: Attempt | None = None
    try:
        prepared = _prepare(store, job_id, runner_id, app.incarnation)
        if isinstance(prepared, Skipped):
            return task_states.finish(self, job_id, prepared.job)
        attempt = (
            _follow_direct(prepared)
            if prepared.handed_over
            else _hand_over(self, prepared, runner_id)
        )
        if attempt is None:
            return task_states.finish(self, job_id, store.jobs.get(job_id))  # cancelled meanwhile
        log.info("job handed to runner", extra={**extra, "direct": prepared.handed_over})
        max_tokens = prepared.job.request.max_tokens
        progress = task_states.TaskProgress(
            self, max_tokens, attempt.events_before, attempt.runner.id
        )
        final = _follow(store, job_id, attempt.runner, attempt.after, progress=progress)
        return task_states.finish(self, job_id, final, max_tokens)
    except Reject as reject:
        soft_limit.decided()
        reason, requeue = reject.args  # (celery-stubs lack the attributes)
        if requeue and isinstance(prepared, Prepared) and _routed_here(self, prepared.job):
            # Its prefix brought it here, not a pin: any host serving the model may run it.
            jobs.resend(store, app, app.settings, prepared.job)
            log.warning(f"{reason}; sent to its model's queue instead", extra=extra)
            raise Reject(reason, requeue=False) from reject
        raise
    except SoftTimeLimitExceeded:
        store.drop_connections()  # the limit may have cut a round trip in half
        log.warning("soft time limit reached; ending the job", extra=extra)
        limited = prepared.job.request.max_tokens if isinstance(prepared, Prepared) else None
        return task_states.finish(self, job_id, _after_soft_limit(store, job_id, attempt), limited)
    except ExoError as exc:
        soft_limit.decided()
        store.jobs.fail(job_id, exc.message)
        log.error("job failed", extra={**extra, "error": exc.message})
        raise


def _runner_for(task: Task[Any, Any], model: str, host: str) -> str:
    """The runner a delivered job goes to: rank 0 of the instance whose queue it came from
    (only the rank-0 host consumes it), else this host's runner for the model."""
    routing_key = (task.request.delivery_info or {}).get("routing_key") or ""
    instance_id = instance_of_queue(routing_key)
    return instance_runner_id(instance_id, 0) if instance_id else runner_id_for(model, host)


def _routed_here(task: Task[Any, Any], job: JobRecord) -> bool:
    """Whether the job came from this host's own queue without being pinned to it: sent here
    by its prompt's prefix (exo_tasks.prefix_routing)."""
    routing_key = (task.request.delivery_info or {}).get("routing_key") or ""
    return job.request.host is None and host_of_queue(routing_key) is not None


def _prepare(store: Store, job_id: str, runner_id: str, incarnation: str) -> Prepared | Skipped:
    """Read the job and its runner; decide from the job's status whether this delivery runs
    it. A running job whose worker is gone is requeued first (this delivery then runs it).
    `incarnation`: this worker's; a job it holds itself is alive, whatever its heartbeat says
    (kombu restores the messages it held when its connection to Redis comes back, before the
    worker's next beat: after an outage longer than the heartbeat's TTL, that beat is gone)."""
    try:
        job, state = store.jobs.with_runner(job_id, runner_id)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise Reject(f"Redis unreachable ({exc}); requeued", requeue=True) from exc
    delivery = lifecycle.on_delivery(job, incarnation)
    if job is None or delivery is lifecycle.Delivery.UNKNOWN:
        log.warning("job unknown or expired; skipped", extra={"job_id": job_id})
        return Skipped(None)
    if delivery is lifecycle.Delivery.ENDED:
        return Skipped(job)
    if delivery is lifecycle.Delivery.FOLLOW:
        return Prepared(job, state, handed_over=True)
    if delivery is lifecycle.Delivery.REDELIVERED:
        if job.owner == incarnation or _owner_lives(store, job):
            extra = {"job_id": job_id, "runner": runner_id}
            log.warning("job runs on a live worker; duplicate message dropped", extra=extra)
            return Skipped(job)
        requeued = store.jobs.requeue(job_id, only_from=job.owner)
        if requeued is not None:
            gone = {"job_id": job_id, "owner": job.owner}
            log.warning("job requeued: its worker is gone; this delivery runs it", extra=gone)
        job = requeued or job
    return Prepared(job, state)


def _owner_lives(store: Store, job: JobRecord) -> bool:
    """Whether the worker incarnation holding a running job beats, or beats again within
    OWNER_BEAT_WAIT_S when its host has no heartbeat at all (not when another incarnation
    beats there: that worker was restarted)."""
    deadline = time.monotonic() + OWNER_BEAT_WAIT_S
    while not store.hosts.owner_is_live(job):
        silent = job.host is not None and store.hosts.get(job.host) is None
        if not silent or time.monotonic() >= deadline:
            return False
        time.sleep(OWNER_BEAT_POLL_S)
    return True


def _follow_direct(prepared: Prepared) -> Attempt:
    """A job handed to its runner as it was submitted (exo_tasks.direct): its first attempt,
    followed from its start. Its runner gone meanwhile (its record too): RunnerGone."""
    if prepared.runner is None:
        raise RunnerGone(f"runner {prepared.job.runner_id} is gone")
    return Attempt(prepared.runner, "0-0", 0)


def _hand_over(task: Task[Any, Any], prepared: Prepared, runner_id: str) -> Attempt | None:
    """Once the runner takes jobs, mark the job running there and put it in its inbox, with
    its deadlines. None if the job was no longer queued (cancelled meanwhile)."""
    app = exo_app(task)
    store, settings, job = app.store, app.settings, prepared.job
    runner = _await_runner(
        store, runner_id, prepared.runner, settings.runner_start_timeout_s, pinned=job.request.host
    )
    # A first attempt has no ending and no events yet: no round trip to find where it starts.
    first = lifecycle.is_first_attempt(job)
    after, events_before = ("0-0", 0) if first else store.streams.attempt_start(job.id)
    started = lifecycle.start(
        job, host=settings.hostname, runner_id=runner_id, owner=app.incarnation
    )
    soft_deadline, deadline = _limits(task, job).deadlines(time.time())
    command = SubmitJob(job=started, soft_deadline=soft_deadline, deadline=deadline)
    while True:  # through a Redis failover or restart (bounded by the task's limits)
        try:
            if store.runners.hand_over(runner_id, command):
                return Attempt(runner, after, events_before)
            # No longer queued: cancelled, or a try whose answer was lost landed (ours, then).
            now = store.jobs.get(job.id)
            mine = now is not None and (now.owner, now.started_at) == (
                app.incarnation,
                started.started_at,
            )
            return Attempt(runner, after, events_before) if mine else None
        except (redis.ConnectionError, redis.TimeoutError):
            time.sleep(REDIS_RETRY_S)  # one compare-and-set: safe to try again


def _limits(task: Task[Any, Any], job: JobRecord) -> limits.JobLimits:
    """The limits the message carries (Celery enforces those), else the job's own."""
    own = limits.job_limits(job.request.timeout_s, exo_app(task).settings)
    hard_limit, soft_limit = task.request.timelimit or (None, None)
    return limits.JobLimits(soft_s=soft_limit or own.soft_s, hard_s=hard_limit or own.hard_s)


def _after_soft_limit(store: Store, job_id: str, attempt: Attempt | None) -> JobEnding | None:
    """The soft limit: a job not handed over yet never ran and times out here; a handed-over
    one is cancelled at its runner, and followed (bounded) from where its attempt began, so an
    ending written just before the limit counts."""
    if attempt is None:
        _time_out(store, job_id)
        return store.jobs.get(job_id)
    store.runners.send(attempt.runner.id, CancelJob(job_id=job_id, reason="time_limit"))
    until = time.monotonic() + CANCEL_ACK_S
    return _follow(store, job_id, attempt.runner, attempt.after, until)


def _await_runner(
    store: Store, runner_id: str, state: RunnerState | None, timeout_s: float, *, pinned: str | None
) -> RunnerState:
    """The runner once it takes jobs (`state`: as just read); a runner still loading is waited
    for, in slices. A job for a runner stopped on purpose goes back to the queue (another host,
    or a later load, will run it); one `pinned` to this host stays queued until the runner is
    loaded again or the job is cancelled."""
    deadline = time.monotonic() + timeout_s
    start_asked = False
    while state is None or not state.status.accepts_jobs:
        if state is not None:
            _refuse_if_stopped(runner_id, state, pinned)
            if state.status == RunnerStatus.UNLOADED and not start_asked:
                # Its idle model was unloaded: load it again.
                store.hosts.send_to_supervisor(state.host, StartRunnerRequest(runner_id=runner_id))
                start_asked = True
        if time.monotonic() > deadline:
            raise RunnerGone(f"runner {runner_id} not ready after {timeout_s:.0f}s")
        time.sleep(0.1)
        try:
            state = store.runners.get(runner_id)
        except (redis.ConnectionError, redis.TimeoutError):
            state = None  # Redis is restarting: keep waiting, within the same bound
    return state


def _refuse_if_stopped(runner_id: str, state: RunnerState, pinned: str | None) -> None:
    if state.status == RunnerStatus.SHUTDOWN:
        if pinned is not None:
            # Only this host takes it: wait for the runner's load, without spinning.
            time.sleep(PINNED_REQUEUE_PAUSE_S)
        raise Reject(f"runner {runner_id} is shut down; requeued", requeue=True)
    if state.is_down:
        raise RunnerGone(f"runner {runner_id} is {state.status}: {state.error or 'stopped'}")


def _follow(
    store: Store,
    job_id: str,
    runner: RunnerState,
    after: str,
    until: float | None = None,
    progress: task_states.TaskProgress | None = None,
) -> JobEnding:
    """Wait for the end of the job's attempt: its first ending after stream position `after`.
    Returns the final record; never waits on a dead runner. A job its runner put back on the
    queue is rejected with requeue, so Celery delivers it again (after a restart, or to
    another host). Whoever ends the job appends the ending, so the checks between waits are
    only for a runner that died silently and for the progress report."""
    while True:
        try:
            for _, ending in store.streams.read_endings(job_id, after, block_ms=WAIT_SLICE_MS):
                if isinstance(ending, RequeuedEvent):
                    raise Reject("runner stopped before the job finished; requeued", requeue=True)
                return ending.job
            _check_on(store, job_id, runner, until, progress)
        except (redis.ConnectionError, redis.TimeoutError):
            time.sleep(REDIS_RETRY_S)  # Redis is restarting; the runner keeps what it owes


def _check_on(
    store: Store,
    job_id: str,
    runner: RunnerState,
    until: float | None,
    progress: task_states.TaskProgress | None,
) -> None:
    """Between two waits: report progress; end the job if its runner is gone or `until` has
    passed. Each ending is appended to the job's endings, which the next wait returns."""
    current, events = store.streams.runner_and_events(runner.id, job_id)
    if progress is not None:
        progress.update(events)
    if current is None or current.pid != runner.pid or current.status.is_final:
        store.jobs.fail(job_id, f"runner {runner.id} stopped while running the job")
    elif until is not None and time.monotonic() > until:
        _time_out(store, job_id)


def _time_out(store: Store, job_id: str) -> None:
    """The runner did not end the job after the soft limit, or never had it: record it as
    timed out ourselves."""
    store.jobs.end(job_id, JobStatus.TIMED_OUT, finish_reason="time_limit")
