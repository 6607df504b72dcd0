"""Real processes for tests and benchmarks: redis-server, `exo-tasks` commands, and the waits
around them. Every process started here is remembered with its descendants and stopped by PID
at teardown, even when the test failed."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests

from config.settings import Settings
from exo_tasks.redis_auth import redis_password
from exo_tasks.redis_server import redis_server_argv, wait_for_redis

EXO_TASKS = str(Path(sys.executable).parent / "exo-tasks")


# The ports tests give their servers: below Linux's ephemeral range (32768-60999), which the
# kernel draws outgoing connections' ports from, so no connection takes one between its pick
# and its server's bind (nor while a restarted server is down); each pytest-xdist process draws
# from a slice of its own, in turn, so two never pick the same one; from a random start, so two
# checkouts' runs seldom meet (and then only on a port free at the pick).
PORTS = range(10_000, 32_768)


@dataclass
class PortDraw:
    """This process's slice of PORTS, handed out in turn."""

    ports: range
    offset: int

    @classmethod
    def of_this_process(cls) -> PortDraw:
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
        size = len(PORTS) // count
        ports = range(PORTS.start + index * size, PORTS.start + (index + 1) * size)
        return cls(ports, random.randrange(size))

    def take(self, count: int) -> int:
        """The first of `count` consecutive ports, free now and not handed out before."""
        for _ in range(len(self.ports)):
            first = self.ports.start + self.offset % (len(self.ports) - count + 1)
            self.offset = first - self.ports.start + count
            if all(_bindable(first + i) for i in range(count)):
                return first
        raise AssertionError(f"no {count} consecutive free ports in {self.ports}")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


PORT_DRAW = PortDraw.of_this_process()


def free_port() -> int:
    return PORT_DRAW.take(1)


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports (the HA stack numbers its own from it)."""
    return PORT_DRAW.take(count)


def wait_until(
    condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05
) -> Any:
    """Poll until `condition()` is truthy; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def has_exited(pid: int) -> bool:
    """Gone, or a zombie: it has exited and waits to be reaped. An orphan's zombie lasts until
    PID 1 reaps it, which some inits (this sandbox's) do only every second or so."""
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal `pid` and its descendants; wait (at most 10 s) until each has exited."""
    try:
        parent = psutil.Process(pid)
        procs = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)
    deadline = time.monotonic() + 10
    while not all(has_exited(proc.pid) for proc in procs) and time.monotonic() < deadline:
        time.sleep(0.02)


@dataclass
class Processes:
    """Every process a test started, for teardown by PID."""

    started: list[subprocess.Popen[bytes]] = field(default_factory=list)
    extra_pids: set[int] = field(default_factory=set)

    def start(
        self, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        log = log_path.open("ab")
        proc = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.started.append(proc)
        return proc

    def remember_descendants(self) -> None:
        for proc in self.started:
            with contextlib.suppress(psutil.NoSuchProcess):
                self.extra_pids.update(c.pid for c in psutil.Process(proc.pid).children(True))

    def stop_all(self) -> None:
        self.remember_descendants()
        for proc in reversed(self.started):
            kill_tree(proc.pid)
            proc.wait(timeout=10)
        for pid in self.extra_pids:
            kill_tree(pid)


@dataclass
class RedisServer:
    url: str
    port: int
    process: subprocess.Popen[bytes]


DEFAULT_MAXMEMORY_MB: int = Settings.model_fields["redis_maxmemory_mb"].default


def embedded_redis_url(redis_dir: Path, port: int) -> str:
    """The URL of a Redis started on `port` with its data (and password) in `redis_dir`."""
    return f"redis://:{redis_password(redis_dir)}@127.0.0.1:{port}/0"


def start_redis(
    processes: Processes,
    data_dir: Path,
    port: int | None = None,
    maxmemory_mb: int = DEFAULT_MAXMEMORY_MB,
) -> RedisServer:
    """A real redis-server as the stack runs it; again on `port` and `data_dir` to restart it."""
    port = port or free_port()
    argv = redis_server_argv(port, data_dir, maxmemory_mb)
    proc = processes.start(argv, dict(os.environ), data_dir / "redis.log")
    url = embedded_redis_url(data_dir, port)
    wait_for_redis(url, timeout_s=10)
    return RedisServer(url=url, port=port, process=proc)


def exo_env(**settings: Any) -> dict[str, str]:
    """This environment without its own EXO_ settings, plus `settings` as EXO_ variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXO_")}
    env.update({f"EXO_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def wait_http(
    url: str, process: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 30
) -> None:
    """Wait until `url` answers 200; fail at once, with the log, if `process` exits first."""

    def answers() -> bool:
        assert process.poll() is None, log_path.read_text(errors="replace")[-3000:]
        try:
            return requests.get(url, timeout=1).status_code == 200
        except (requests.ConnectionError, requests.Timeout):
            return False

    wait_until(answers, timeout_s, url, interval_s=0.2)


@dataclass(frozen=True)
class ApiServer:
    """`exo-tasks api` (gunicorn) as `start_api` started it: its master process, port and log."""

    master: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_serving(self) -> None:
        """Until its /healthz answers; fail at once, with the log, if the master exits first."""
        wait_http(f"{self.url}/healthz", self.master, self.log_path)


def start_api(processes: Processes, log_path: Path, **settings: Any) -> ApiServer:
    """`exo-tasks api` (gunicorn) on a free port, `settings` its EXO_ variables, once it serves."""
    port = free_port()
    master = processes.start([EXO_TASKS, "api"], exo_env(api_port=port, **settings), log_path)
    api = ApiServer(master, port, log_path)
    api.wait_serving()
    return api
