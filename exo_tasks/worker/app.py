"""The worker: one `celery worker` per host, with the runner supervisor as a bootstep.

`exo-tasks worker` builds its app from the settings it is given (`main`); `celery -A
exo_tasks.worker.app worker` loads `app`, built from the environment on first use (Flower has
an app of its own: exo_tasks.flower_app).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
from typing import Any, cast

import redis
from celery import bootsteps, current_app
from celery.signals import worker_process_init, worker_process_shutdown
from celery.worker import components, state
from celery.worker.control import control_command

from config.settings import Settings
from exo_tasks import forks, instance_service, jobs, recovery
from exo_tasks.batch import process as batch_process
from exo_tasks.broker import Broker, close_every_channel
from exo_tasks.celery_app import ExoCelery
from exo_tasks.commands import Restate
from exo_tasks.fleet import Fleet
from exo_tasks.fleet_types import HostState, RunnerStatus
from exo_tasks.logs import configure_logging
from exo_tasks.naming import host_queue, model_queue, model_slug, node_name, runner_id_for
from exo_tasks.store import Store
from exo_tasks.types import utcnow
from exo_tasks.worker import revocation, stop_begins
from exo_tasks.worker.ranks import RankKeeper
from exo_tasks.worker.supervisor import RunnerSupervisor

log = logging.getLogger("exo_tasks.worker")


class RunnerSupervisorStep(bootsteps.StartStopStep):
    """Announces this worker incarnation and starts the runners and the recovery loop before
    the pool forks; stops the runners after the pool has drained."""

    label = "runner supervisor"

    def create(self, worker: Any) -> RunnerSupervisor:  # type: ignore[override]
        # The pool's children (and the batch feeder) are forked from this process: each keeps
        # the pages holding what this process made up to its fork shared, not copied.
        forks.freeze_at_fork()
        app: ExoCelery = worker.app
        app.prepare_forks()
        node = worker.hostname
        settings, store = app.settings, app.store
        # Set before the pool forks: every pool child names it as the owner of the jobs it runs.
        app.incarnation = recovery.new_incarnation(settings.hostname)

        self.stopping = threading.Event()  # set as the worker's shutdown begins

        def consume(queue: str, serving: bool) -> None:
            if self.stopping.is_set():
                # Celery cancels every task consumer as it stops; a broadcast to this worker
                # would be read only at the end of its stop, once the pool has drained.
                return
            # Through remote control, so the consumer changes inside the worker's event loop.
            change = app.control.add_consumer if serving else app.control.cancel_consumer
            change(queue, destination=[node])
            log.info(
                "queue %s", "consumed" if serving else "no longer consumed", extra={"queue": queue}
            )

        supervisor = RunnerSupervisor(
            settings, store, on_serving=lambda model, on: consume(model_queue(model), on)
        )
        self.keeper = RankKeeper(settings, store, supervisor, consume)
        host = HostState(
            name=settings.hostname,
            pid=os.getpid(),
            incarnation=app.incarnation,
            models=supervisor.models,
            concurrency=worker.concurrency,
            started_at=utcnow(),
        )
        self.presence = recovery.Presence(
            store,
            host,
            held=_held_delivery_tags,
            on_return=lambda: _restate_failed_runners(store, settings.hostname, supervisor.models),
        )
        self.recovery = recovery.Recovery(
            store,
            Broker(store.redis, app.connection_for_write),
            lambda job: jobs.resend(store, app, settings, job),
            lambda job_id: jobs.send_direct_task(store, app, settings, job_id),
            host=settings.hostname,
            incarnation=app.incarnation,
            # A task waits this long at most for its runner before it hands the job over.
            stuck_after_s=settings.runner_start_timeout_s + recovery.STUCK_MARGIN_S,
        )

        self.feeder: Any = None  # started in start()

        def on_stopped() -> None:
            self.keeper.stop()
            if self.feeder is not None:
                batch_process.stop(self.feeder)
            self.recovery.stop()
            self.presence.stop()

        supervisor.on_stopped = on_stopped

        def leave(cold: bool) -> None:
            if worker.hub is not None:
                # Celery's loop sees the shutdown only once its poll returns: up to 1 s later
                # when idle. A callback wakes it, so the pool closes now.
                worker.hub.call_soon(lambda: None)
            try:
                self.presence.leave()  # out of /v1/hosts, routing and /readyz at once
            except redis.RedisError as exc:
                log.warning("shutdown not announced", extra={"error": str(exc)})
            self.keeper.leave(cold)  # its instances stop too

        stop = stop_begins.StopBegins(
            self.stopping, supervisor.drain, settings.worker_soft_shutdown_s, leave
        )
        stop.connect()
        return supervisor

    def info(self, worker: Any) -> dict[str, str]:  # type: ignore[override]
        """Part of the worker's `stats`, which Flower shows on the worker's page (its Other
        tab): this host's runners and the instances it has a rank in."""
        try:
            return Fleet.load(worker.app.store).host_view(worker.app.settings.hostname)
        except redis.RedisError as exc:  # a stats reply must not fail for it
            return {"exo_runners": f"unknown: {exc}"}

    def start(self, worker: Any) -> None:
        previous = self.presence.start()
        self.recovery.start(previous)
        # The same EXO_INSTANCES on every worker places each instance once (its id is its
        # placement's), Pending until its hosts are live.
        instance_service.place_configured(worker.app.store, worker.app.settings)
        # Drives OpenAI batches, in one worker at a time (its own lease), in its own process.
        self.feeder = batch_process.start(worker.app.settings, worker.app.incarnation)
        super().start(worker)
        self.keeper.start()


def _held_delivery_tags() -> list[str]:
    """The broker messages whose tasks a pool child has started here. A message only reserved
    (received, not yet started) is left out on purpose: with one message per pool child it
    waits for a free child for moments only, and one that waits longer is stuck in the pool;
    the recovery loop then gives it back to the queue, and whichever copy starts second finds
    the job taken. Read from another thread while Celery's loop may change it."""
    for _ in range(3):
        try:
            return [request.message.delivery_tag for request in list(state.active_requests)]
        except RuntimeError:  # changed while we copied it
            continue
    return []


def _restate_failed_runners(store: Store, host: str, models: list[str]) -> None:
    """This host's runners written Failed while its heartbeat had lapsed (exo_tasks.recovery
    takes a host without one for gone) publish their own state again: one that is running is
    not Failed. A runner that did fail leaves the command in its inbox, where a restart of it
    reads it and publishes what it is then."""
    ids = [runner_id_for(model, host) for model in models]
    failed = [i for i in ids if (s := store.runners.get(i)) and s.status is RunnerStatus.FAILED]
    if failed:
        store.runners.send_each((runner_id, Restate()) for runner_id in failed)
        log.warning(
            "runners written Failed while the heartbeat lapsed restated", extra={"runners": failed}
        )


def create_worker_app(settings: Settings) -> ExoCelery:
    # Bootstep order among siblings is not guaranteed; making the pool require the supervisor
    # puts the supervisor's start before the pool's and its stop (steps stop in reverse) after
    # it. Celery names the pool step by its class, so the requirement goes on that class.
    if RunnerSupervisorStep not in (components.Pool.requires or ()):
        components.Pool.requires = (*(components.Pool.requires or ()), RunnerSupervisorStep)
    close_every_channel()  # or a Redis restart can end the worker (exo_tasks/broker.py)
    app = ExoCelery(settings, role="worker")
    app.steps["worker"].add(RunnerSupervisorStep)
    revocation.register()  # Flower's revoke and terminate cancel the job
    return app


@functools.cache
def default_app() -> ExoCelery:
    """The app for `celery -A exo_tasks.worker.app`: built from the environment's settings on
    first use, not at import."""
    return create_worker_app(Settings())


def __getattr__(name: str) -> Any:
    # `celery -A exo_tasks.worker.app` and `from exo_tasks.worker.app import app` read `app`.
    if name == "app":
        return default_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@worker_process_init.connect
def _pool_child_init(**_: Any) -> None:
    # Own process group: a signal to the worker's group (honcho, Ctrl-C) must not kill in-flight
    # tasks; the worker's main process decides how they stop.
    os.setpgid(0, 0)
    stop_begins.bound_result_wait()
    # Celery made the worker's app current before the fork.
    cast(ExoCelery, current_app).renew_store()


@worker_process_shutdown.connect
def _pool_child_exit(exitcode: int = 0, **_: Any) -> None:
    # billiard's pool child, past its last task (its results read by the worker: billiard waits
    # for that first), would next tell the worker it is exiting and sleep 1 s for the SIGTERM
    # that answer brings. While the worker stops nothing reads it, so every stop took 1 s more
    # than its last task (the launcher's 3.5 s stage overran on 2 busy cores). It exits now.
    os._exit(exitcode)


@control_command(args=[("mode", str)], signature="<warm|cold>")
def exo_shutdown(state: Any, mode: str = "warm") -> dict[str, str]:
    """POST /v1/hosts/<host>/shutdown: the same path as SIGTERM (warm) or SIGQUIT (cold)."""
    return _shut_down(mode)


@control_command(name="shutdown")
def warm_shutdown(state: Any, **_: Any) -> dict[str, str]:
    """Celery's `shutdown` (Flower's Shut Down, `celery control shutdown`) made our warm
    shutdown. Celery's own raises WorkerShutdown in the consumer: no worker_shutting_down
    signal, so no drain window and nothing requeued; it waited for every running job, without
    a bound, while the host stayed listed and ready."""
    return _shut_down("warm")


def _shut_down(mode: str) -> dict[str, str]:
    os.kill(os.getpid(), signal.SIGQUIT if mode == "cold" else signal.SIGTERM)
    return {"ok": f"{mode} shutdown started"}


def worker_argv(settings: Settings, concurrency: int | None = None) -> list[str]:
    """The `celery worker` options for this host: its node name, its queues and its pool."""
    queues = [host_queue(settings.hostname)] + [
        model_queue(model_slug(m)) for m in settings.served_models
    ]
    most = concurrency or settings.worker_concurrency
    # A running job holds its pool child (DESIGN: a pool child runs each task), so the pool is a
    # batch wide at most; idle, it keeps a few. The autoscaler forks a child as a task arrives
    # that finds none free, and stops idle ones 30-60 s after the last task came.
    idle = min(settings.worker_idle_concurrency, most)
    pool = [f"--autoscale={most},{idle}"] if idle < most else []
    return [
        f"--hostname={node_name(settings.hostname)}",
        f"--queues={','.join(queues)}",
        f"--concurrency={most}",
        *pool,
        f"--loglevel={settings.log_level}",
        "--pool=prefork",
        "--without-mingle",
        "--without-gossip",
    ]


def main(settings: Settings, concurrency: int | None = None) -> None:
    configure_logging(settings.log_level, host=settings.hostname, process="worker")
    app = create_worker_app(settings)
    # Celery's `worker` command, as `app.worker_main` runs it, less the `celery` command around
    # it, whose import brings every other command and plugin (its shells' prompt_toolkit,
    # Flower and Tornado, ...): ~11 MiB that this process held, and forked into its children.
    # What that command gives `worker` is its context: the app, and NO_COLOR read as it does.
    from celery.bin.base import CLIContext
    from celery.bin.worker import worker as worker_command

    context = CLIContext(app=app, no_color=bool(os.environ.get("NO_COLOR")), workdir=None)
    worker_command.main(
        worker_argv(settings, concurrency),
        prog_name="celery worker",
        obj=context,
        standalone_mode=False,
    )
