"""Worker incarnations, job ownership, and the recovery loop.

Every stop that runs the stopping process's own code is bounded by that code (docs/shutdown.md).
Every other stop (SIGKILL, the OOM killer, a host losing power, a launcher that dies) is decided
here, from what the system knows of who is alive, never from the broker's visibility timeout:

- Each run of a worker is an *incarnation*; its heartbeat (an expiring key, every 2 s) names it
  and lists the broker messages it holds unacknowledged. A job handed to a runner records the
  incarnation that holds it (`JobRecord.owner`).
- One recovery loop, held by one worker at a time (a lease in Redis), sweeps every 2 s:
  messages that no live incarnation holds go back to their queue; running jobs whose owner is
  gone are requeued (compare-and-set on that owner: never taken from a live attempt); queued
  jobs whose message is in no queue and not unacknowledged anywhere (kombu pops a message before
  it records it, so a SIGKILL in between loses it) are sent again; queued jobs that a prompt
  prefix sent to a dead host's own queue go to their model's; a dead host's runners are
  marked `Failed`; and the runner of every running job is asked whether it still holds it (a
  Redis failover can lose a job's ending: the job is back to `running` under a live worker
  that no longer runs it), and requeues it if not.
- The task of a short job handed over directly is sent by its API process once due
  (exo_tasks.direct); one that process did not live to send is sent by the sweep, LOST_GRACE_S
  after it was due.
- A worker that starts requeues what its previous incarnation on the same host held, at once.
- After Redis was unreachable, no sweep judges anyone for HEARTBEAT_TTL_S: an outage longer
  than that expired every heartbeat, and the hosts alive all along need a beat to say so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

import redis

from exo_tasks import lifecycle
from exo_tasks.broker import Broker, Messages
from exo_tasks.commands import CheckJobs, JobCheck
from exo_tasks.fleet_types import HostState, RunnerState, RunnerStatus
from exo_tasks.naming import host_of_queue, node_name
from exo_tasks.store import JobWhereabouts, Store, redis_waits
from exo_tasks.types import JobRecord, JobStatus, utcnow

log = logging.getLogger("exo_tasks.recovery")
HEARTBEAT_INTERVAL_S = 2.0
# How often the heartbeat looks at what this worker holds: a change is published at once, so
# routing does not judge a host by a job it finished up to a whole interval ago.
HELD_POLL_S = 0.1
# A host whose heartbeat is this old is gone: the API stops routing to it and its work is
# recovered. Five missed beats, so a busy machine is not declared dead.
HEARTBEAT_TTL_S = 10.0
SWEEP_INTERVAL_S = 2.0
LEASE_TTL_S = 3 * SWEEP_INTERVAL_S
# A message taken by a live worker shows in that worker's next heartbeat; one older than this
# that no live worker lists is orphaned.
UNACKED_GRACE_S = HEARTBEAT_TTL_S
# A task that started this long after its runner's start timeout without handing its job over
# is stuck in its pool child. A backstop: the one such hang seen (a pool child forked while a
# thread held the Redis pool's lock, ExoCelery.renew_store) can no longer happen.
STUCK_MARGIN_S = 60.0
# A queued job whose message is nowhere is sent again only once it was seen so this far apart
# (the API records a job a moment before it sends the message).
LOST_GRACE_S = 5.0


def new_incarnation(host: str) -> str:
    return f"{host}:{os.getpid()}:{int(time.time() * 1000)}"


def host_of(incarnation: str) -> str:
    return incarnation.rsplit(":", 2)[0]


class Presence:
    """This worker's heartbeat: the host, its incarnation and the messages it holds."""

    def __init__(
        self,
        store: Store,
        state: HostState,
        held: Callable[[], list[str]],
        on_return: Callable[[], None] = lambda: None,
    ) -> None:
        """`on_return`: called after a beat that found the previous one expired (the fleet had
        taken this host for gone), on the heartbeat's thread."""
        self.store = store
        self.state = state
        self.held = held
        self.on_return = on_return
        self._closing = threading.Event()
        self._lock = threading.Lock()

    @property
    def incarnation(self) -> str:
        return self.state.incarnation

    def start(self) -> HostState | None:
        """Announce this incarnation; returns the previous one's last heartbeat, if it had not
        expired yet (it died without a clean stop)."""
        previous = self.store.hosts.get(self.state.name)
        self.beat()
        threading.Thread(target=self._run, name="heartbeat", daemon=True).start()
        return (
            previous if previous is not None and previous.incarnation != self.incarnation else None
        )

    def beat(self, held: list[str] | None = None) -> bool:
        """Whether the previous beat had not expired (True after stop(): nothing to say)."""
        with self._lock:  # never after stop() removed the host
            if self._closing.is_set():
                return True
            held = self.held() if held is None else held
            state = self.state.model_copy(update={"updated_at": utcnow(), "held": held})
            return self.store.hosts.publish(state, HEARTBEAT_TTL_S)

    def _run(self) -> None:
        published = self.held()
        next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S
        while not self._closing.wait(HELD_POLL_S):
            held = self.held()
            if held == published and time.monotonic() < next_beat:
                continue
            try:
                if not self.beat(held):
                    log.warning("heartbeat back after it had expired")
                    self.on_return()
            except redis.RedisError as exc:  # tried again in an interval, not at every poll
                log.warning("heartbeat not sent", extra={"error": str(exc)})
            published, next_beat = held, time.monotonic() + HEARTBEAT_INTERVAL_S

    def leave(self) -> None:
        """A shutdown has begun: the heartbeat says so at once (the fleet drops the host), and
        goes on until stop(), for the jobs this incarnation still owns."""
        with self._lock:
            self.state = self.state.model_copy(update={"stopping": True})
        self.beat()

    def stop(self) -> None:
        """A clean stop: the host is gone at once, not when its heartbeat expires."""
        with self._lock:
            self._closing.set()
            with contextlib.suppress(redis.RedisError):
                self.store.hosts.remove(self.state.name)


class Recovery:
    """The recovery loop (see the module's docstring). `resend` sends a job's message again;
    `send_direct_task` the task of a job handed over directly (jobs.send_direct_task)."""

    def __init__(
        self,
        store: Store,
        broker: Broker,
        resend: Callable[[JobRecord], None],
        send_direct_task: Callable[[str], bool],
        *,
        host: str,
        incarnation: str,
        stuck_after_s: float,
    ) -> None:
        self.store = store
        self.broker = broker
        self.resend = resend
        self.send_direct_task = send_direct_task
        self.host = host
        self.incarnation = incarnation
        self.stuck_after_s = stuck_after_s
        self._missing_since: dict[str, float] = {}
        self._closing = threading.Event()
        # After Redis was unreachable, every host may have lost its heartbeat meanwhile (an
        # outage longer than their TTL): nobody is judged dead until all could beat again.
        self._judge_from = 0.0

    def start(self, previous: HostState | None) -> None:
        self.recover_own_host(previous)
        threading.Thread(target=self._run, name="recovery", daemon=True).start()

    def stop(self) -> None:
        self._closing.set()

    def _run(self) -> None:
        while not self._closing.wait(SWEEP_INTERVAL_S):
            try:
                if self.store.hosts.hold_lease(self.incarnation, LEASE_TTL_S):
                    self.sweep()
            except Exception as exc:  # the loop must outlive any sweep
                if redis_waits(exc):  # unreachable or full: no heartbeat could be written
                    self._judge_from = time.monotonic() + HEARTBEAT_TTL_S
                    log.warning("recovery sweep not done; retrying", extra={"error": str(exc)})
                else:
                    log.exception("recovery sweep failed; retrying")

    def recover_own_host(self, previous: HostState | None) -> None:
        """A worker starting on this host: what an earlier incarnation here held is orphaned
        for sure, so it is recovered now rather than after its heartbeat expires. Its running
        jobs are requeued before its messages are restored: a restored message taken at once
        (by any worker) finds its job queued, not running on a worker that is gone."""
        self._requeue_running(
            self.store.jobs.active(),
            lambda owner: host_of(owner) == self.host,
            "its worker on this host was restarted",
        )
        if previous is not None and previous.held:
            self.broker.restore(previous.held)
            log.warning(
                "messages of the previous worker on this host restored",
                extra={"incarnation": previous.incarnation, "messages": len(previous.held)},
            )

    def sweep(self) -> None:
        now = time.time()
        active = self.store.jobs.active()
        messages = self.broker.messages(job.queue for job in active if job.queue)
        if time.monotonic() >= self._judge_from:
            self._judge(active, messages, now)
        # Not judged from heartbeats (the runners decide): asked even right after an outage,
        # when a failover may have lost the endings.
        self._ask_runners(active, messages, now)
        self._send_overdue_direct_tasks(now)

    def _judge(self, active: list[JobWhereabouts], messages: Messages, now: float) -> None:
        """What heartbeats decide: who is gone, and what their work becomes."""
        hosts, runners = self.store.hosts.fleet()
        held = {tag for h in hosts for tag in h.held}
        queued = {job.id for job in active if job.status == JobStatus.QUEUED}
        self._restore_orphaned_messages(messages, held, queued, now)
        live = {h.incarnation for h in hosts}
        self._requeue_running(
            active, lambda owner: owner not in live, "its worker is gone (no heartbeat)"
        )
        self._resend_lost(active, messages, now)
        self._reroute_from_gone_hosts(active, {h.name for h in hosts})
        self._fail_runners_of_gone_hosts({h.name for h in hosts}, runners)

    def _send_overdue_direct_tasks(self, now: float) -> None:
        """The tasks of jobs handed over directly that their API process did not send
        LOST_GRACE_S after they were due: it stopped or died in between."""
        for job_id in self.store.direct_tasks.due_before(now - LOST_GRACE_S):
            if self.send_direct_task(job_id):  # not if its API process took it meanwhile
                log.warning("direct job's task sent for its API process", extra={"job_id": job_id})

    def _ask_runners(self, active: list[JobWhereabouts], messages: Messages, now: float) -> None:
        """Ask the runner of every running job whether it still holds it. A Redis master that
        fails over before its replica has the last writes can take a job's ending with it: the
        job is running again on the new master, owned by a live worker, and no runner runs it.
        Each runner is asked about all its jobs in one command; it answers
        (exo_tasks.runner.in_flight) after every command before (the jobs' hand-overs) and after
        writing its own endings: it requeues a job it does not hold only then."""
        asked: dict[str, list[JobCheck]] = {}
        for job in active:
            if job.status != JobStatus.RUNNING or job.attempt is None:
                continue
            if job.runner_id is None or job.owner is None:
                continue
            check = JobCheck(job_id=job.id, owner=job.owner, attempt=job.attempt)
            asked.setdefault(job.runner_id, []).append(check)
            if not messages.has_task(job.id):
                # No task holds its message to give it back once requeued (it saw the ending
                # before Redis lost it): sent again at the next sweep, not LOST_GRACE_S later.
                self._missing_since[job.id] = now - LOST_GRACE_S
        self.store.runners.send_each(
            (runner_id, CheckJobs(jobs=checks)) for runner_id, checks in asked.items()
        )

    def _restore_orphaned_messages(
        self, messages: Messages, held: set[str], queued: set[str], now: float
    ) -> None:
        """Messages no live worker holds, and those a live worker started so long ago that its
        job should have been handed over (or failed) by then: its pool child is stuck."""
        orphaned = [
            u.tag
            for u in messages.unacked
            if (u.tag not in held and u.age_s(now) > UNACKED_GRACE_S)
            or (u.task_id in queued and u.age_s(now) > self.stuck_after_s)
        ]
        if orphaned:
            self.broker.restore(orphaned)
            log.warning(
                "orphaned messages restored to their queues", extra={"messages": len(orphaned)}
            )

    def _requeue_running(
        self, active: list[JobWhereabouts], orphaned: Callable[[str], bool], why: str
    ) -> None:
        """Requeue the running jobs whose owner (a worker incarnation) is `orphaned`."""
        for job in active:
            if job.status == JobStatus.RUNNING and job.owner and orphaned(job.owner):
                self._requeue(job, why)

    def _requeue(self, job: JobWhereabouts, why: str) -> None:
        requeued = self.store.jobs.requeue(job.id, only_from=job.owner)
        if job.runner_id is not None:
            self.store.runners.release_job(job.runner_id, job.id)
        if requeued is not None:
            extra = {"job_id": job.id, "owner": job.owner, "attempt": requeued.attempts}
            log.warning(f"job requeued: {why}", extra=extra)

    def _resend_lost(self, active: list[JobWhereabouts], messages: Messages, now: float) -> None:
        """Queued jobs whose message is in no queue and held by no worker, seen so twice
        LOST_GRACE_S apart, get a new message (one sweep at a time: the lease)."""
        queued = [j for j in active if j.status == JobStatus.QUEUED]
        missing = {j.id for j in queued if not messages.has_task(j.id)}
        for job_id in set(self._missing_since) - missing:
            del self._missing_since[job_id]
        for job_id in missing:
            since = self._missing_since.setdefault(job_id, now)
            job = self.store.jobs.get(job_id) if now - since >= LOST_GRACE_S else None
            if job is not None and job.status == JobStatus.QUEUED:
                del self._missing_since[job_id]
                self.resend(job)
                log.warning("lost message sent again", extra={"job_id": job_id})

    def _reroute_from_gone_hosts(self, active: list[JobWhereabouts], live_hosts: set[str]) -> None:
        """Queued jobs waiting in the own queue of a host that is gone, sent there by their
        prompt's prefix (exo_tasks.prefix_routing), go to their model's queue: any host serving
        the model may run them. A job pinned there waits for its host."""
        for where in active:
            host = host_of_queue(where.queue)
            if where.status != JobStatus.QUEUED or host is None or host in live_hosts:
                continue
            job = self.store.jobs.get(where.id)
            if job is not None and job.status == JobStatus.QUEUED and job.request.host is None:
                self.resend(job)
                extra = {"job_id": job.id, "host": host}
                log.warning("job sent to its model's queue: its prefix's host is gone", extra=extra)

    def _fail_runners_of_gone_hosts(self, live_hosts: set[str], runners: list[RunnerState]) -> None:
        for runner in runners:
            if runner.host in live_hosts or runner.is_down:
                continue
            error = f"host {node_name(runner.host)} gone (no heartbeat)"
            failed = lifecycle.move_runner(
                runner,
                RunnerStatus.FAILED,
                error=error,
                active_jobs=0,
                next_restart_at=None,
                updated_at=utcnow(),
            )
            if failed is not None:
                self.store.runners.publish(failed)
                log.error("runner marked failed", extra={"runner": runner.id, "error": error})
