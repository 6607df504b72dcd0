"""The runner supervisor's rules and records: how long each step of its escalation waits, how
a runner's exit is worded, how long a crashed runner waits before its restart, and what the
supervisor keeps of each runner. No processes are started or signalled here."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

from exo_tasks.commands import StopRunner
from exo_tasks.runner import process as runner_process

# Called with (model, serving?) when a runner stops or starts serving on purpose.
ServingCallback = Callable[[str, bool], None]
# Called with a rank's handle, exit code and cause when a rank of an instance exits.
RankExitCallback = Callable[["RunnerHandle", int, str], None]
# Called once every runner has stopped for good: the host leaves the fleet.
StoppedCallback = Callable[[], None]

# The escalation: after the grace, SIGTERM and wait this long, then SIGKILL and wait this long.
TERM_WAIT_S = 5.0
KILL_WAIT_S = 5.0

# A runner that stayed up this long had recovered: its next crash starts a new count.
HEALTHY_UPTIME_S = 60.0


def exit_cause(exitcode: int | None) -> str:
    """exo's wording: 'Terminated (signal 9 SIGKILL)' for a signal, 'exitcode=N' otherwise
    ('exitcode=143 (SIGTERM)' for a runner that exited on SIGTERM by itself)."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        return f"Terminated (signal {-exitcode} {signal.Signals(-exitcode).name})"
    if exitcode == runner_process.EXIT_TERMINATED:  # it exited on SIGTERM itself
        return f"exitcode={exitcode} (SIGTERM)"
    return f"exitcode={exitcode}"


def in_thread(target: Callable[..., object], *args: object) -> threading.Thread:
    """Run `target(*args)` in a daemon thread of its own, started."""
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def restart_backoff_s(failures_in_a_row: int) -> float:
    return float(min(30.0, 0.5 * 2 ** max(failures_in_a_row - 1, 0)))


@dataclass
class RunnerHandle:
    spec: runner_process.RunnerSpec
    process: BaseProcess | None = None
    progress: runner_process.RunnerProgress | None = None
    started_monotonic: float = 0.0
    failures_in_a_row: int = 0
    restarts: int = 0
    stop: StopRunner | None = None  # set while an intended stop is under way
    stall: str | None = None  # set while a hung runner is being stopped
    restart_at: float | None = None
