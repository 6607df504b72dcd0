"""EXO_REDIS_SENTINELS, read: apart from exo_tasks.redis_sentinel, which imports redis-py, so
that reading the settings does not (the launcher and `exo-tasks redis` need little else)."""

from __future__ import annotations

DEFAULT_PORT = 26379


def parse_addresses(text: str) -> list[tuple[str, int]]:
    """`host:port,host:port,...` (the port defaults to 26379); ValueError naming a bad entry."""
    addresses = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        host, colon, port = entry.rpartition(":")
        if not colon:
            host, port = entry, str(DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"EXO_REDIS_SENTINELS: {entry!r} is not host:port")
        addresses.append((host, int(port)))
    return addresses
