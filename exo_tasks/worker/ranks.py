"""The ranks this host runs, in the worker's main process: desired state in, rank runners out.

Every KEEP_INTERVAL_S the keeper reads the instances that name this host (their records in
Redis are the desired state, so a worker that was offline learns it on start) and makes its
rank follow: started for the instance's current generation, stopped when the instance stops,
fails, or moves to another generation. Rank runners are the supervisor's runners (the same
process, statuses, stall watchdog and escalation); the keeper is told when one exits.

The instance's moves are shared out: the rank-0 host starts it (Pending → Starting, once all
its hosts are live), declares it Ready (every rank serving) and restarts a failed one; any of
its hosts fails it (its own rank died, or another rank's host lost its heartbeat) or finishes a
shutdown (no rank runs), each move a compare-and-set, the first cause winning. The rank-0 host also
consumes the instance's queue while its rank 0 serves, and fails the jobs rank 0 held with the
instance's cause.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Literal

from config.settings import Settings
from exo_tasks import lifecycle
from exo_tasks.commands import StopRunner
from exo_tasks.fleet_types import RunnerStatus
from exo_tasks.instances import (
    FAILED,
    PENDING,
    READY,
    SHUTDOWN,
    SHUTTING_DOWN,
    STARTING,
    InstanceRecord,
    RankRecord,
    ShutdownMode,
    move,
)
from exo_tasks.naming import find_model, instance_queue, instance_runner_id, model_slug
from exo_tasks.recovery import HEARTBEAT_TTL_S
from exo_tasks.runner.process import RunnerSpec, rank_failure
from exo_tasks.store import Store, redis_waits
from exo_tasks.types import utcnow
from exo_tasks.worker.supervision import RunnerHandle, exit_cause, in_thread
from exo_tasks.worker.supervisor import RunnerSupervisor

log = logging.getLogger("exo_tasks.ranks")
KEEP_INTERVAL_S = 0.5
# A rank that lost its ring peer, or stalled in a collective, may not be the cause: this long
# for the rank that died (or its host, once its heartbeat is gone) to be named first.
PEER_CAUSE_WAIT_S = HEARTBEAT_TTL_S / 2
# A failed instance starts again this long after its failure at the soonest (no tight loop).
RESTART_DELAY_S = 2.0
EXIT_STALE = 4  # exo_tasks.runner.rank.EXIT_STALE (that module loads with the runner)
EXIT_PEER_LOST = 5  # exo_tasks.runner.main.EXIT_PEER_LOST
FINAL = (RunnerStatus.SHUTDOWN, RunnerStatus.FAILED, RunnerStatus.WAITING_FOR_MODEL)
# A hard stop's wait for rank 0 to end its jobs and close the ring (the supervisor's own for a
# runner's hard stop).
HARD_WAIT_S = 1.0
Consume = Callable[[str, bool], None]
StopHow = Literal["now", "hard", "warm"]


class RankKeeper:
    def __init__(
        self, settings: Settings, store: Store, supervisor: RunnerSupervisor, consume: Consume
    ) -> None:
        self.settings, self.store, self.supervisor = settings, store, supervisor
        self.host = settings.hostname
        self.consume = consume
        self.leaving = False
        self._consumed: set[str] = set()
        self._started: dict[str, int] = {}  # runner id -> the generation last started here
        self._stopping: set[str] = set()  # runner ids a stop is under way for
        self._closing = threading.Event()
        supervisor.on_rank_exit = self._on_exit

    def start(self) -> None:
        threading.Thread(target=self._run, name="rank-keeper", daemon=True).start()

    def stop(self) -> None:
        self._closing.set()

    def _run(self) -> None:
        while not self._closing.wait(KEEP_INTERVAL_S):
            try:
                self.keep_once()
            except Exception as exc:  # the keeper must outlive any round
                if redis_waits(exc):  # a line, not a traceback twice a second, while it lasts
                    log.warning("keeping the ranks not done; retrying", extra={"error": str(exc)})
                else:
                    log.exception("keeping the ranks failed; retrying")

    def keep_once(self) -> None:
        instances = [i for i in self.store.instances.all() if self.host in i.hosts]
        mine = {self._runner_id(i) for i in instances}
        ranks = [i for i, h in list(self.supervisor.handles.items()) if h.spec.rank is not None]
        for runner_id in ranks:
            if runner_id not in mine:  # its instance was removed
                self._stop(runner_id, "now")
        for instance in instances:
            self._keep(instance)

    def _runner_id(self, instance: InstanceRecord) -> str:
        return instance_runner_id(instance.id, instance.hosts.index(self.host))

    def _keep(self, instance: InstanceRecord) -> None:
        rank = instance.hosts.index(self.host)
        handle = self.supervisor.handles.get(self._runner_id(instance))
        self._mirror(instance, rank, handle)
        if instance.status is PENDING:
            self._start_if_due(instance, rank)
        elif instance.status in (STARTING, READY):
            self._run_rank(instance, rank, handle)
        elif instance.status is SHUTTING_DOWN:
            self._shut_down(instance, rank, handle)
        else:
            if handle is not None:
                self._stop(handle.spec.runner_id, "now")
            self._restart_if_due(instance, rank)
        if rank == 0:
            serving = instance.status is READY and handle is not None and not self.leaving
            self._set_consumed(instance.id, serving)

    # --- the instance's moves ---

    def _start_if_due(self, instance: InstanceRecord, rank: int) -> None:
        if rank == 0 and not self.leaving and not self._dead_hosts(instance):
            self.store.instances.transition(instance.id, STARTING, generation=instance.generation)

    def _run_rank(self, instance: InstanceRecord, rank: int, handle: RunnerHandle | None) -> None:
        runner_id = self._runner_id(instance)
        if (
            handle is not None
            and handle.spec.rank
            and handle.spec.rank.generation != instance.generation
        ):
            self._stop(runner_id, "now")  # a rank of an older start
        elif handle is None and self._started.get(runner_id) != instance.generation:
            if instance.status is READY:  # this worker started after the ring formed
                self._fail(instance, rank_failure(rank, self.host, "its runner is not running"))
            elif not self.leaving:
                self._spawn(instance, rank)
        dead = self._dead_hosts(instance)
        if dead:
            r = instance.hosts.index(dead[0])
            self._fail(instance, rank_failure(r, dead[0], "its host's heartbeat is gone"))
        elif instance.status is STARTING:
            self._ready_or_late(instance, rank)

    def _ready_or_late(self, instance: InstanceRecord, rank: int) -> None:
        late = [r for r in instance.ranks if not r.status.accepts_jobs]
        waited = (utcnow() - instance.updated_at).total_seconds()
        if not late and rank == 0:
            self.store.instances.transition(instance.id, READY, generation=instance.generation)
        elif late and waited > self.settings.runner_start_timeout_s:
            first = late[0]
            cause = f"not serving {waited:.0f}s after the start (EXO_RUNNER_START_TIMEOUT_S)"
            self._fail(instance, rank_failure(first.rank, first.host, cause))

    def _shut_down(self, instance: InstanceRecord, rank: int, handle: RunnerHandle | None) -> None:
        """Warm: rank 0 drains, then closes the ring, which releases the other ranks; hard (or
        past the grace): every rank is stopped at once. Any of its hosts finishes the move once
        no rank runs (rank 0's may be the one leaving): Shutdown, or Failed when a leaving host
        caused it (started again once that host is back)."""
        if handle is not None:
            how: StopHow = "hard" if instance.shutdown_mode == "hard" else "warm"
            self._stop(handle.spec.runner_id, how, requeue=instance.error is not None)
        elif all(r.status in FINAL for r in instance.ranks):
            to = FAILED if instance.error else SHUTDOWN
            self.store.instances.transition(
                instance.id, to, error=instance.error, generation=instance.generation
            )

    def _restart_if_due(self, instance: InstanceRecord, rank: int) -> None:
        if instance.status is not FAILED or rank != 0 or self.leaving:
            return
        since = (utcnow() - instance.updated_at).total_seconds()
        stopped = all(r.status in FINAL for r in instance.ranks)
        if since >= RESTART_DELAY_S and stopped and not self._dead_hosts(instance):
            log.info("instance starts again", extra={"instance": instance.id})
            self.store.instances.apply(move(instance, PENDING))

    def _fail(self, instance: InstanceRecord, error: str) -> None:
        if self.store.instances.transition(
            instance.id, FAILED, error=error, generation=instance.generation
        ):
            log.error("instance failed", extra={"instance": instance.id, "error": error})

    def _dead_hosts(self, instance: InstanceRecord) -> list[str]:
        return [h for h in instance.hosts if self.store.hosts.get(h) is None]

    # --- this host's rank ---

    def _spawn(self, instance: InstanceRecord, rank: int) -> None:
        served = find_model(instance.model, [model_slug(m) for m in self.settings.served_models])
        paths = {model_slug(m): m for m in self.settings.served_models}
        model_path = paths[served] if served else instance.model_path
        spec = RunnerSpec.for_rank(instance, rank, model_path, self.settings)
        self._started[spec.runner_id] = instance.generation
        log.info("rank starts", extra={"runner": spec.runner_id, "generation": instance.generation})
        self.supervisor.add_rank(spec)

    def _stop(self, runner_id: str, how: StopHow, requeue: bool = False) -> None:
        """Stop a rank by the supervisor's escalation, once (in a thread of its own). `now`:
        SIGTERM at once (a rank of a failed or older start); `hard`: rank 0 ends its jobs at
        its next step and closes the ring, which releases the other ranks (each waits a moment
        longer than rank 0 for that); `warm`: rank 0 drains first, for up to the grace."""
        if runner_id in self._stopping:
            return
        self._stopping.add(runner_id)
        grace = self.settings.runner_shutdown_grace_s if how == "warm" else 0.0
        mode: ShutdownMode = "warm" if how == "warm" else "hard"
        command = StopRunner(mode=mode, timeout_s=grace, requeue=requeue)
        handle = self.supervisor.handles.get(runner_id)
        follower = handle is not None and handle.spec.rank is not None and handle.spec.rank.rank > 0
        wait_s = 0.0 if how == "now" else grace + HARD_WAIT_S * (2 if follower else 1)
        in_thread(self._stop_and_unmark, runner_id, command, wait_s)

    def _stop_and_unmark(self, runner_id: str, command: StopRunner, wait_s: float) -> None:
        """The escalation, then the stop is no longer under way, whatever it found: a rank that
        exited between a round's look at it and this stop leaves no handle to stop, and a mark
        left behind would keep every later start of that rank (the same runner id) from being
        stopped, its instance from starting again."""
        try:
            self.supervisor.stop_runner(runner_id, command, wait_s)
        finally:
            self._stopping.discard(runner_id)

    def leave(self, hard: bool) -> None:
        """This worker is stopping: its instances shut down (warm: rank 0 drains), and fail
        with this host named, so that they start again once it is back."""
        self.leaving = True
        for instance in self.store.instances.all():
            if self.host in instance.hosts and instance.status in (PENDING, STARTING, READY):
                error = rank_failure(
                    instance.hosts.index(self.host), self.host, "its worker stopped"
                )
                mode: ShutdownMode = "hard" if hard else "warm"
                leave = move(instance, SHUTTING_DOWN, error=error, shutdown_mode=mode)
                self.store.instances.apply(leave)

    def _set_consumed(self, instance_id: str, serving: bool) -> None:
        if serving == (instance_id in self._consumed):
            return
        self.consume(instance_queue(instance_id), serving)
        if serving:
            self._consumed.add(instance_id)
        else:
            self._consumed.discard(instance_id)

    def _mirror(self, instance: InstanceRecord, rank: int, handle: RunnerHandle | None) -> None:
        """This host's rank's record, as its runner publishes its state: written only if its
        status is still the one read with `instance`, for the rank's exit may have been settled
        meanwhile (a stale "not running" overwrote a clean Shutdown)."""
        record = instance.ranks[rank]
        current = handle is not None and handle.spec.rank is not None
        current = current and handle.spec.rank.generation == instance.generation  # type: ignore[union-attr]
        if current and handle is not None and handle.process is not None:
            state = self.store.runners.get(handle.spec.runner_id)
            address = self.store.instances.addresses(instance.id, instance.generation).get(rank)
            update = {
                "pid": handle.process.pid,
                "status": state.status if state else record.status,
                "error": state.error if state else None,
                "weights_bytes": state.weights_bytes if state else None,
                "address": address[0] if address else None,
                "port": address[1] if address else None,
            }
        elif record.status not in FINAL:
            update = {"pid": None, "status": RunnerStatus.FAILED, "error": "not running"}
        else:
            return
        self._write_rank(instance, record, update, seen=record.status)

    def _write_rank(
        self,
        instance: InstanceRecord,
        record: RankRecord,
        update: Mapping[str, object],
        seen: RunnerStatus | None = None,
    ) -> None:
        changed = record.model_copy(update=update)
        if changed != record:
            changed = changed.model_copy(update={"updated_at": utcnow()})
            self.store.instances.set_rank(instance.id, instance.generation, changed, seen)

    def _on_exit(self, handle: RunnerHandle, exitcode: int, cause: str) -> None:
        """The supervisor saw one of our ranks exit (any cause; in a thread of its own). Its
        runner's state shows the exit only once the instance's cause is settled and rank 0's
        jobs failed with it: a job's task that saw the runner gone first would fail the job
        with a cause of its own."""
        spec = handle.spec
        assert spec.rank is not None
        last = self.store.runners.get(spec.runner_id)
        if last is not None and last.status == RunnerStatus.FAILED and last.error:
            cause = f"{last.error} ({cause})"  # it said why before it exited
        try:
            self._settle_exit(handle, exitcode, cause)
        finally:
            self._publish_exit(spec, exitcode, cause)
        log.info("rank exited", extra={"runner": spec.runner_id, "cause": exit_cause(exitcode)})

    def _settle_exit(self, handle: RunnerHandle, exitcode: int, cause: str) -> None:
        spec = handle.spec
        assert spec.rank is not None
        instance = self.store.instances.get(spec.rank.instance_id)
        if instance is None or instance.generation != spec.rank.generation:
            return
        # A rank stopped as hung failed, however it exits: it may exit 0 once unblocked.
        clean = exitcode in (0, EXIT_STALE) and handle.stall is None
        intended = handle.stop is not None and handle.stall is None
        status = RunnerStatus.SHUTDOWN if clean else RunnerStatus.FAILED
        record = instance.ranks[spec.rank.rank]
        self._write_rank(
            instance, record, {"pid": None, "status": status, "error": None if clean else cause}
        )
        if not (clean or intended) and instance.status in (STARTING, READY):
            if exitcode == EXIT_PEER_LOST or handle.stall:  # a peer may be the cause
                instance = self._await_cause(instance)
            self._fail(instance, rank_failure(spec.rank.rank, spec.host, cause))
        if spec.rank.rank == 0:
            self._set_consumed(instance.id, False)
            latest = self.store.instances.get(instance.id) or instance
            ended = "failed" if latest.status is FAILED else "stopped"
            error = f"instance {instance.id} {ended}: {latest.error or cause}"
            failed = self.store.runners.fail_jobs(spec.runner_id, error)
            if failed:
                log.error("jobs failed with their instance", extra={"jobs": ",".join(failed)})

    def _publish_exit(self, spec: RunnerSpec, exitcode: int, cause: str) -> None:
        """The rank runner's last state, as the supervisor publishes a runner's: Shutdown after
        a clean exit (it said so itself), else Failed with the cause."""
        last = self.store.runners.get(spec.runner_id) or spec.first_state()
        if exitcode == EXIT_STALE:
            cause = "start abandoned: its instance moved on"
        to = RunnerStatus.SHUTDOWN if exitcode == 0 else RunnerStatus.FAILED
        error = None if exitcode == 0 else cause
        final = lifecycle.move_runner(last, to, error=error, active_jobs=0, updated_at=utcnow())
        if final is not None:
            self.store.runners.publish(final)

    def _await_cause(self, instance: InstanceRecord) -> InstanceRecord:
        """Wait (bounded) for the rank that died, or its host, to be named as the cause."""
        deadline = time.monotonic() + PEER_CAUSE_WAIT_S
        while time.monotonic() < deadline:
            latest = self.store.instances.get(instance.id)
            if latest is None or latest.status.is_final:
                return latest or instance
            dead = self._dead_hosts(instance)
            if dead:
                self._fail(
                    instance,
                    rank_failure(
                        instance.hosts.index(dead[0]), dead[0], "its host's heartbeat is gone"
                    ),
                )
            time.sleep(KEEP_INTERVAL_S)
        return instance
