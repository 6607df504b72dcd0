"""How the stack file tells its launcher from a reused pid (exo_tasks.lifeline.started)."""

from __future__ import annotations

import os
import sys

import psutil
import pytest

from exo_tasks.launcher import RecordedProcess


def test_a_recorded_process_is_found_again() -> None:
    record = RecordedProcess.of("launcher", psutil.Process(os.getpid()))
    found = record.member()
    assert found is not None and found.process.pid == os.getpid()


def test_another_start_on_the_same_pid_is_not_the_recorded_process() -> None:
    record = RecordedProcess.of("launcher", psutil.Process(os.getpid()))
    reused = record.model_copy(update={"create_time": record.create_time - 5.0})
    assert reused.member() is None


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/stat's btime is Linux's")
def test_an_adjusted_wall_clock_does_not_make_a_running_process_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """psutil's create_time is /proc/stat's btime (whole seconds, moved by a clock adjustment)
    plus the ticks since boot: `down` once took a running stack's launcher for gone."""
    from psutil import _pslinux

    record = RecordedProcess.of("launcher", psutil.Process(os.getpid()))
    booted = _pslinux.boot_time()
    monkeypatch.setattr(_pslinux, "boot_time", lambda: booted + 1.0)
    assert record.member() is not None


def test_a_stack_recorded_by_an_earlier_version_is_found_again() -> None:
    """Its record holds psutil's create_time: `down` still stops that stack after an upgrade."""
    process = psutil.Process(os.getpid())
    record = RecordedProcess(name="launcher", pid=process.pid, create_time=process.create_time())
    assert record.member() is not None
