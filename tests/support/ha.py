"""The HA stack's Redis in tests: free ports for it, its settings, what its Sentinels say, and
which process is its master."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
import redis

from config.settings import Settings
from tests.support.processes import free_ports


def ha_settings(data_dir: Path) -> dict[str, Any]:
    """EXO_ settings of an HA stack of its own: its data dir, its five ports."""
    first = free_ports(5)  # one block: two draws could overlap
    return {
        "data_dir": data_dir,
        "redis_ha": "true",
        "redis_port": first,
        "redis_sentinel_port": first + 2,
    }


def settings_of(values: dict[str, Any]) -> Settings:
    return Settings(_env_file=None, **values)


def sentinel_client(settings: Settings, port: int) -> Any:
    """A client of one Sentinel (Any: redis-py types its replies `bool`)."""
    sentinels = settings.sentinels
    assert sentinels is not None and sentinels.sentinel_password is not None
    password = sentinels.sentinel_password.get_secret_value()
    return redis.Redis(port=port, password=password, decode_responses=True, socket_timeout=2)


def master_port(settings: Settings) -> int:
    """The master's port, as the first Sentinel names it."""
    client = sentinel_client(settings, settings.ha_sentinel_ports[0])
    _, port = client.sentinel_get_master_addr_by_name(settings.redis_master_name)
    return int(port)


def server_process(root: int, port: int, *, sentinel: bool = False) -> psutil.Process:
    """The redis-server (or Sentinel) under `root` that listens on `port`."""
    for proc in psutil.Process(root).children(recursive=True):
        words = " ".join(proc.cmdline()).split()  # its title: "redis-server HOST:PORT [sentinel]"
        if ("sentinel" in words[-1]) == sentinel and f"127.0.0.1:{port}" in words:
            return proc
    raise AssertionError(f"no redis-server on port {port} under pid {root}")
