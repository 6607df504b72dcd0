"""The worker: one `celery worker` per host, with the runner supervisor as a bootstep.

`celery -A exo_tasks.worker worker` and `exo-tasks worker` both load `app` from here.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
from typing import Any

from celery import bootsteps
from celery.signals import worker_process_init, worker_shutting_down
from celery.worker import components
from celery.worker.control import control_command

from config.settings import Settings, model_slug
from exo_tasks.celery_app import ExoCelery
from exo_tasks.logs import configure_logging
from exo_tasks.supervisor import RunnerSupervisor
from exo_tasks.types import host_queue, model_queue

log = logging.getLogger("exo_tasks.worker")


class RunnerSupervisorStep(bootsteps.StartStopStep):
    """Starts the runners before the pool forks and stops them after the pool has drained."""

    label = "runner supervisor"

    def create(self, worker: Any) -> RunnerSupervisor:  # type: ignore[override]
        app: ExoCelery = worker.app
        node = worker.hostname

        def set_serving(model: str, serving: bool) -> None:
            # Through remote control, so the consumer changes inside the worker's event loop.
            change = app.control.add_consumer if serving else app.control.cancel_consumer
            change(model_queue(model), destination=[node])
            log.info(
                "model queue %s",
                "consumed" if serving else "no longer consumed",
                extra={"queue": model_queue(model)},
            )

        supervisor = RunnerSupervisor(app.settings, app.store, on_serving=set_serving)

        def on_shutting_down(how: str = "Warm", **_: Any) -> None:
            # Warm: in-flight jobs get the window. Cold (also a second Ctrl-C during a warm
            # shutdown): the runners requeue their jobs now.
            supervisor.drain(app.settings.worker_soft_shutdown_s if how == "Warm" else 0.0)

        # Runs inside Celery's signal handler: drain() only records a deadline.
        worker_shutting_down.connect(on_shutting_down, weak=False)
        return supervisor


# Bootstep order among siblings is not guaranteed; making the pool require the supervisor puts
# the supervisor's start before the pool's and its stop (steps stop in reverse) after it.
components.Pool.requires = (*(components.Pool.requires or ()), RunnerSupervisorStep)


def create_worker_app(settings: Settings) -> ExoCelery:
    app = ExoCelery(settings)
    app.steps["worker"].add(RunnerSupervisorStep)
    return app


@worker_process_init.connect
def _pool_child_init(**_: Any) -> None:
    # Own process group: a signal to the worker's group (honcho, Ctrl-C) must not kill in-flight
    # tasks; the worker's main process decides how they stop.
    os.setpgid(0, 0)


@control_command(args=[("mode", str)], signature="<warm|cold>")
def exo_shutdown(state: Any, mode: str = "warm") -> dict[str, str]:
    """POST /v1/hosts/<host>/shutdown: the same path as SIGTERM (warm) or SIGQUIT (cold)."""
    os.kill(os.getpid(), signal.SIGQUIT if mode == "cold" else signal.SIGTERM)
    return {"ok": f"{mode} shutdown started"}


def worker_argv(settings: Settings, concurrency: int | None = None) -> list[str]:
    """The `celery worker` arguments for this host: its node name and its queues."""
    queues = [host_queue(settings.hostname)] + [
        model_queue(model_slug(m)) for m in settings.served_models
    ]
    return [
        "worker",
        f"--hostname=exo@{settings.hostname}",
        f"--queues={','.join(queues)}",
        f"--concurrency={concurrency or settings.worker_concurrency}",
        f"--loglevel={settings.log_level}",
        "--pool=prefork",
        "--without-mingle",
        "--without-gossip",
    ]


def main(concurrency: int | None = None) -> None:
    configure_logging(settings.log_level, host=settings.hostname, process="worker")
    # Children are forked from here: keep what exists now out of the cycle collector's way so
    # copy-on-write pages stay shared.
    gc.freeze()
    app.worker_main(worker_argv(settings, concurrency))


settings = Settings()
app = create_worker_app(settings)
