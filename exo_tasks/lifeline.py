"""Child processes that cannot outlive the process that started them, and how a recorded
process is known again."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

import psutil

PR_SET_PDEATHSIG = 1
# Looked up once here, not between fork and exec.
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def die_with_parent() -> None:
    """A `preexec_fn`: on Linux the child gets SIGTERM when its parent dies, SIGKILL included.

    The setting survives exec. It is tied to the thread that forked: fork from one that lives as
    long as the parent (the main thread). When a parent with several threads dies, the child gets
    the signal once per thread that exits after the forking one (seen: two SIGTERMs), so a
    repeated SIGTERM must not count as a second, more urgent, request. Elsewhere than on Linux
    the children watch their parent themselves.
    """
    if _libc is not None:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def still_running(process: psutil.Process) -> bool:
    """Running, and not a zombie left for its parent to reap."""
    try:
        return bool(process.is_running() and process.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def started(process: psutil.Process) -> float:
    """When `process` started, in seconds: with its pid, it tells a reused pid apart. On Linux
    the time since boot, from /proc: psutil's create_time adds /proc/stat's btime, whole
    seconds that move when the wall clock is adjusted (a running stack's launcher was once
    taken for gone by `down`). Elsewhere its create_time, fixed as it started."""
    if sys.platform != "linux":
        return float(process.create_time())
    try:
        stat = Path(f"/proc/{process.pid}/stat").read_text()
    except FileNotFoundError:
        raise psutil.NoSuchProcess(process.pid) from None
    # Field 22, starttime in clock ticks; the fields after the name (in parentheses) from 3.
    ticks = int(stat.rpartition(")")[2].split()[19])
    return ticks / os.sysconf("SC_CLK_TCK")
