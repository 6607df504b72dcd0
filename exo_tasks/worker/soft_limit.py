"""Celery's soft time limit reaches a task only until the task's outcome is decided.

The worker's main process sends the pool child SIGUSR1 at the soft limit, and billiard's handler
raises SoftTimeLimitExceeded wherever the child is. A job its runner timed out by its own
deadline (the same limit, counted from the hand-over) often ends a moment before that signal:
the task then raises JobEnded, and the signal lands in Celery's tracer while it stores that
failure and sends its event. Nothing catches it there: the tracer stored and reported
SoftTimeLimitExceeded() over the job's JobEnded (and over a SUCCESS stored at the limit, a
job's failure, a requeue). Once the task's outcome is decided (its job's ending in
task_states.finish, a requeue or a failure in tasks.inference), the signal is ignored; every
task starts with the limit armed again (a limit so short that it fires before that start is
left to the runner, which ends the job at the same deadline)."""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

from billiard.pool import SIG_SOFT_TIMEOUT
from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import task_prerun

_decided = False


def decided() -> None:
    """The task's outcome is decided: a soft limit from now on changes nothing."""
    global _decided
    _decided = True


def _on_soft_limit(signum: int, frame: FrameType | None) -> None:
    if not _decided:
        raise SoftTimeLimitExceeded()


@task_prerun.connect
def arm(**_: Any) -> None:
    """Before each task, in the pool child's main thread. billiard installs its own handler
    after the child's initialiser (worker_process_init), so ours is installed here."""
    global _decided
    _decided = False
    if SIG_SOFT_TIMEOUT is not None:
        signal.signal(SIG_SOFT_TIMEOUT, _on_soft_limit)
