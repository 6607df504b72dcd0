"""`exo-tasks up`, the local stack's own launcher, and `exo-tasks down`.

`up` starts the Procfile's processes (the one list of them; `honcho start` runs the same file),
each in its own session, so a terminal's Ctrl-C reaches only the launcher, and on Linux each gets
SIGTERM if the launcher dies, SIGKILL included. It stops them in exo's order: the worker first (it
drains, then puts what is left back on the queue while Redis is still up), then api and flower,
Redis last. A process that exits on its own is reported; the others keep running.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil
from pydantic import BaseModel

from config.settings import Settings
from exo_tasks.errors import ExoError
from exo_tasks.lifeline import die_with_parent, started, still_running
from exo_tasks.redis_auth import private_dir, write_private
from exo_tasks.redis_ha import ha_ports

log = logging.getLogger("exo_tasks.launcher")
PROCFILE = Path(__file__).resolve().parent.parent / "Procfile"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
POLL_S = 0.05
# The worker drains for EXO_STACK_DRAIN_S, then requeues what is left and stops its runners:
# a runner reads its stop between two steps (on 2 busy cores its loop read one 1.1 s late), and
# Celery's own stop of its pool takes 0.8-1.5 s after the runners have gone.
WORKER_STOP_MARGIN_S = 4.0
API_STOP_S = 2.0
REDIS_STOP_S = 2.0
DOWN_WAIT_S = 15.0


@dataclass(frozen=True)
class Stage:
    """Processes stopped together with SIGTERM, given `bound_s` before SIGKILL. On a second
    stop signal they get `urgent` (the worker's cold shutdown: requeue now)."""

    names: tuple[str, ...]
    bound_s: float
    urgent: signal.Signals | None = None


def stop_stages(settings: Settings) -> list[Stage]:
    return [
        Stage(("worker",), settings.stack_drain_s + WORKER_STOP_MARGIN_S, signal.SIGQUIT),
        Stage(("api", "flower"), API_STOP_S),
        Stage(("redis",), REDIS_STOP_S),
    ]


@dataclass(frozen=True)
class ProcfileEntry:
    name: str
    command: str


def read_procfile(path: Path = PROCFILE) -> list[ProcfileEntry]:
    entries = []
    for line in path.read_text().splitlines():
        name, colon, command = line.partition(":")
        if colon and name.strip() and not name.lstrip().startswith("#"):
            entries.append(ProcfileEntry(name.strip(), command.strip()))
    return entries


class Member:
    """One process of the stack: the launcher's own child, or one recorded in the stack file."""

    def __init__(self, name: str, process: psutil.Process, *, own_child: bool = False) -> None:
        self.name = name
        self.process = process
        self.own_child = own_child
        self.exitcode: int | None = None
        self.gone = False

    def alive(self) -> bool:
        if self.gone:
            return False
        if self.own_child:
            # Reaped here. (Its status can read "zombie" while its other threads still exit.)
            try:
                self.exitcode = self.process.wait(timeout=0)
            except psutil.TimeoutExpired:
                return True
        elif still_running(self.process):
            return True
        self.gone = True
        return False

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True

    def signal(self, signum: int) -> None:
        if self.alive():
            with contextlib.suppress(psutil.NoSuchProcess):
                self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL to its process group too (it leads one): gunicorn's workers, say."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.signal(signal.SIGKILL)


def stop_in_order(members: list[Member], settings: Settings, signals: Callable[[], int]) -> None:
    """Stop the stack stage by stage; `signals()` counts the stop signals received so far."""
    for stage in stop_stages(settings):
        group = [m for m in members if m.name in stage.names and m.alive()]
        for member in group:
            log.info("stopping", extra={"child": member.name, "pid": member.process.pid})
            member.signal(signal.SIGTERM)
        for member in _wait_stage(stage, group, signals):
            extra = {"child": member.name, "pid": member.process.pid, "bound_s": stage.bound_s}
            log.error("did not stop in time; sending SIGKILL", extra=extra)
            member.kill()
        for member in group:
            if member.wait(1.0):
                log.info("stopped", extra={"child": member.name, "exitcode": member.exitcode})


def _wait_stage(stage: Stage, group: list[Member], signals: Callable[[], int]) -> list[Member]:
    """Wait up to the stage's bound for `group` to exit, passing a second stop signal on as the
    stage's urgent one; returns the members still running."""
    deadline = time.monotonic() + stage.bound_s
    urgent_sent = False
    while (running := [m for m in group if m.alive()]) and time.monotonic() < deadline:
        if stage.urgent is not None and signals() > 1 and not urgent_sent:
            for member in running:
                log.info("second signal: stopping at once", extra={"child": member.name})
                member.signal(stage.urgent)
            urgent_sent = True
        time.sleep(POLL_S)
    return running


# --- the stack file: which launcher and processes run from a data dir ---


class RecordedProcess(BaseModel):
    name: str
    pid: int
    create_time: float  # lifeline.started: tells a reused pid apart

    @classmethod
    def of(cls, name: str, process: psutil.Process) -> RecordedProcess:
        return cls(name=name, pid=process.pid, create_time=started(process))

    def member(self) -> Member | None:
        """The process, if it still runs (and is the one recorded)."""
        try:
            process = psutil.Process(self.pid)
            recorded = self.create_time
            # A record written by an earlier version holds psutil's create_time.
            same = abs(started(process) - recorded) < 0.1
            same = same or abs(process.create_time() - recorded) < 0.1
        except psutil.NoSuchProcess:
            return None
        member = Member(self.name, process)
        return member if same and member.alive() else None


class StackRecord(BaseModel):
    launcher: RecordedProcess
    processes: list[RecordedProcess]


def stack_file(settings: Settings) -> Path:
    return settings.data_dir / "run" / "stack.json"


def running_stack(settings: Settings) -> tuple[StackRecord, Member] | None:
    """The stack started from this data dir and its launcher, while the launcher runs."""
    path = stack_file(settings)
    if not path.exists():
        return None
    record = StackRecord.model_validate_json(path.read_text())
    launcher = record.launcher.member()
    return (record, launcher) if launcher is not None else None


# --- up ---


def _port_holder(host: str, port: int) -> str | None:
    """None when `port` is free on `host`, else who holds it."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            return None
        except OSError:
            pass
    for conn in psutil.net_connections(kind="inet"):
        if conn.laddr and conn.laddr.port == port and conn.pid is not None:
            try:
                command = shlex.join(psutil.Process(conn.pid).cmdline())
            except psutil.Error:
                command = "?"
            return f"pid {conn.pid}: {command}"
    return "a process this user cannot see"


def check_ports(settings: Settings, names: list[str]) -> None:
    ports = [
        ("redis", "EXO_REDIS_PORT", "127.0.0.1", settings.redis_port),
        ("api", "EXO_API_PORT", settings.api_host, settings.api_port),
        ("flower", "EXO_FLOWER_PORT", "127.0.0.1", settings.flower_port),
    ]
    ports += [("redis", variable, "127.0.0.1", port) for variable, port in ha_ports(settings)]
    taken = [
        f"port {port} ({variable}) is taken by {holder}"
        for name, variable, host, port in ports
        if name in names and (holder := _port_holder(host, port)) is not None
    ]
    if taken:
        raise ExoError(
            "; ".join(taken) + ". A stack started earlier? `exo-tasks down` (with the same "
            "EXO_DATA_DIR) stops it; or stop that process, or choose other ports."
        )


class Launcher:
    def __init__(self, settings: Settings, entries: list[ProcfileEntry]) -> None:
        self.settings = settings
        self.entries = entries
        self.members: list[Member] = []
        self.signals: list[int] = []
        self.width = max(len(entry.name) for entry in entries)
        self.output_lock = threading.Lock()
        self.output_lost = False

    def run(self) -> int:
        for signum in STOP_SIGNALS:
            signal.signal(signum, lambda signum, _: self.signals.append(signum))
        # This install's commands first on the children's PATH, whatever they run by name.
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        env = {**os.environ, "PATH": path, "PYTHONUNBUFFERED": "1"}
        # Every child first, from this thread (the death signal is tied to the forking thread),
        # before any other thread runs.
        started = [(entry.name, self._start(entry, env)) for entry in self.entries]
        pumps = [
            threading.Thread(target=self._pump, args=(name, pipe), daemon=True)
            for name, pipe in started
        ]
        for pump in pumps:
            pump.start()
        path_file = stack_file(self.settings)
        self._record(path_file)
        try:
            self._watch()
            if self.signals:
                log.info(
                    "stopping the stack", extra={"signal": signal.Signals(self.signals[0]).name}
                )
                stop_in_order(self.members, self.settings, lambda: len(self.signals))
        finally:
            path_file.unlink(missing_ok=True)
        for pump in pumps:
            pump.join(timeout=1.0)
        return 0 if self.signals else 1

    def _start(self, entry: ProcfileEntry, env: dict[str, str]) -> IO[bytes]:
        argv = shlex.split(entry.command)
        # `.venv/bin/exo-tasks` in the Procfile (honcho runs it from the project's root
        # whether the venv is activated or not): here, this install's, wherever `up` runs.
        if Path(argv[0]).name == "exo-tasks":
            argv[0] = str(Path(sys.executable).parent / "exo-tasks")
        popen = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self.members.append(Member(entry.name, psutil.Process(popen.pid), own_child=True))
        log.info("started", extra={"child": entry.name, "pid": popen.pid})
        assert popen.stdout is not None
        return popen.stdout

    def _record(self, path: Path) -> None:
        record = StackRecord(
            launcher=RecordedProcess.of("launcher", psutil.Process()),
            processes=[RecordedProcess.of(m.name, m.process) for m in self.members],
        )
        private_dir(path.parent)
        partial = path.with_suffix(".tmp")
        write_private(partial, record.model_dump_json(indent=1))
        partial.replace(path)

    def _watch(self) -> None:
        """Until a stop signal, or until every process has exited on its own."""
        while not self.signals:
            for member in self.members:
                if not member.gone and not member.alive():
                    log.warning(
                        "exited; the others keep running",
                        extra={"child": member.name, "exitcode": member.exitcode},
                    )
            if all(member.gone for member in self.members):
                log.info("every process has exited")
                return
            time.sleep(POLL_S)

    def _pump(self, name: str, pipe: IO[bytes]) -> None:
        """Each line of a child's output, prefixed with its name, as honcho does."""
        prefix = f"{name:<{self.width}} | ".encode()
        for line in iter(pipe.readline, b""):
            self._write(time.strftime("%H:%M:%S ").encode() + prefix + line)
        pipe.close()

    def _write(self, data: bytes) -> None:
        # Once the terminal is gone (SIGHUP, EIO) keep draining the pipes, so no child blocks on
        # a full one, and print nothing more: the stop must go on.
        with self.output_lock:
            if self.output_lost:
                return
            try:
                while data:
                    data = data[os.write(sys.stdout.fileno(), data) :]
            except OSError:
                self.output_lost = True


def up(settings: Settings) -> int:
    external = settings.redis_url or settings.redis_sentinels
    entries = [e for e in read_procfile() if not (e.name == "redis" and external)]
    running = running_stack(settings)
    if running is not None:
        raise ExoError(
            f"a stack started from {settings.data_dir} is running (launcher pid "
            f"{running[0].launcher.pid}); stop it with `exo-tasks down`"
        )
    check_ports(settings, [entry.name for entry in entries])
    with contextlib.suppress(OSError):
        print(f"exo_tasks API   http://{settings.api_host}:{settings.api_port}  (try /v1/runners)")
        print(f"Flower          http://127.0.0.1:{settings.flower_port}")
        print(
            "Ctrl-C stops it in order: jobs that end within "
            f"{settings.stack_drain_s:g} s finish, the rest go back to the queue. "
            "Again: at once, still requeuing.",
            flush=True,
        )
    return Launcher(settings, entries).run()


# --- down ---


def down(settings: Settings) -> int:
    """Stop the stack started from this data dir: through its launcher if it runs, else its
    recorded processes, in the same order."""
    path = stack_file(settings)
    if not path.exists():
        print(f"no stack recorded in {path}: nothing to stop")
        return 1
    running = running_stack(settings)
    if running is not None:
        record, launcher = running
        print(f"stopping the stack of launcher pid {record.launcher.pid} (SIGTERM)", flush=True)
        launcher.signal(signal.SIGTERM)
        if not launcher.wait(DOWN_WAIT_S):
            print(f"the launcher did not stop within {DOWN_WAIT_S:g} s: SIGKILL", flush=True)
            launcher.kill()  # its processes get SIGTERM from the kernel
        print("stopped")
        return 0
    record = StackRecord.model_validate_json(path.read_text())
    members = [m for p in record.processes if (m := p.member()) is not None]
    print(
        f"launcher pid {record.launcher.pid} is gone; stopping what is left of its stack: "
        f"{', '.join(f'{m.name} (pid {m.process.pid})' for m in members) or 'nothing'}",
        flush=True,
    )
    stop_in_order(members, settings, lambda: 1)
    path.unlink(missing_ok=True)
    print("stopped")
    return 0
