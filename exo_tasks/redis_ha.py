"""The HA stack's own Redis (`exo-tasks up --ha`, EXO_REDIS_HA): two redis-servers, a master and
its replica, and three Sentinels that watch them, all from the embedded `redis-server` binary,
on loopback, with the stack's password (the Sentinels' too). Every process of the stack finds the
master through the Sentinels (Settings.sentinels). docs/ha.md runs the same across hosts."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from config.settings import Settings
from exo_tasks.redis_auth import private_dir, redis_password, write_private

# Two of the three Sentinels must agree the master is down before one of them promotes the
# replica: one Sentinel cut off from the others never does.
QUORUM = 2
# How long the master must not answer before a Sentinel counts it down (Redis's own default is
# 30 s); a failover then takes ~2 s more (measured: docs/ha.md).
DOWN_AFTER_MS = 2000
# A failover that stalls or aborts is tried again after twice this. Sentinel 6.2 aborts one
# ("-failover-abort-no-good-slave") when its last INFO from the replica is over 5 s old, which
# a machine under load hit in CI: with 10 s the retry came 20 s later, the hosts' heartbeats
# (10 s) had lapsed on the new master, and jobs were refused as served by no host. At 2 s the
# retry comes 4 s later, within those heartbeats; a promotion here takes well under 1 s.
# (Redis's default, 3 min, would leave the stack without a master for 6 min.)
FAILOVER_TIMEOUT_MS = 2_000


def server_dir(settings: Settings, port: int) -> Path:
    """The first server keeps the embedded Redis's directory (and data); the other its own."""
    redis_dir = settings.data_dir / "redis"
    return redis_dir if port == settings.redis_port else redis_dir / f"server-{port}"


def sentinel_conf_path(settings: Settings, port: int) -> Path:
    return settings.data_dir / "redis" / f"sentinel-{port}" / "sentinel.conf"


def server_ports(settings: Settings) -> list[int]:
    return [settings.redis_port, settings.redis_port + 1]


def ha_ports(settings: Settings) -> list[tuple[str, int]]:
    """The ports the HA stack's Redis takes beside EXO_REDIS_PORT (none without EXO_REDIS_HA)."""
    if not settings.redis_ha:
        return []
    sentinels = [("EXO_REDIS_SENTINEL_PORT", port) for port in settings.ha_sentinel_ports]
    return [("EXO_REDIS_PORT + 1", settings.redis_port + 1), *sentinels]


def current_master(settings: Settings) -> int:
    """The server the Sentinels last named master, else the first: a stack started again after a
    failover keeps the promoted one. Each Sentinel rewrites its file with the master it follows
    and the epoch of that configuration; one that was down during the failover still names the
    old master, at an older epoch."""
    name = re.escape(settings.redis_master_name)
    monitor = re.compile(rf"^sentinel monitor {name} \S+ (\d+) ", re.MULTILINE)
    epoch = re.compile(rf"^sentinel config-epoch {name} (\d+)$", re.MULTILINE)
    named = []  # (epoch, port) of each Sentinel's file
    for port in settings.ha_sentinel_ports:
        path = sentinel_conf_path(settings, port)
        text = path.read_text() if path.exists() else ""
        if (master := monitor.search(text)) and int(master[1]) in server_ports(settings):
            named.append((int(found[1]) if (found := epoch.search(text)) else 0, int(master[1])))
    return max(named)[1] if named else settings.redis_port


def sentinel_id(settings: Settings, port: int) -> str:
    """A Sentinel's run id, fixed by its stack's data directory and port, so that each one's
    file can name the others before any of them runs."""
    return hashlib.sha1(f"{settings.data_dir.resolve()}:{port}".encode()).hexdigest()


def sentinel_conf(settings: Settings, port: int, master_port: int) -> Path:
    """A Sentinel's config file, written afresh at each start (the Sentinel rewrites it).

    It names the replica and the other Sentinels: a Sentinel otherwise learns the replica from
    the master's INFO (the first one may come before the replica attached, the next 10 s later)
    and the other Sentinels from their hellos through the servers (every 2 s). A master lost in
    that window was never failed over: with no replica known and no other Sentinel to agree
    it is down, none could act (CI, on a loaded machine)."""
    password = redis_password(settings.data_dir / "redis")
    name = settings.redis_master_name
    path = sentinel_conf_path(settings, port)
    private_dir(path.parent)
    lines = [
        f"port {port}",
        "bind 127.0.0.1",
        f"dir {path.parent.resolve()}",
        f"requirepass {password}",
        f"sentinel myid {sentinel_id(settings, port)}",
        f"sentinel sentinel-pass {password}",
        f"sentinel monitor {name} 127.0.0.1 {master_port} {QUORUM}",
        f"sentinel auth-pass {name} {password}",
        f"sentinel down-after-milliseconds {name} {DOWN_AFTER_MS}",
        f"sentinel failover-timeout {name} {FAILOVER_TIMEOUT_MS}",
    ]
    lines += [
        f"sentinel known-replica {name} 127.0.0.1 {replica}"
        for replica in server_ports(settings)
        if replica != master_port
    ]
    lines += [
        f"sentinel known-sentinel {name} 127.0.0.1 {other} {sentinel_id(settings, other)}"
        for other in settings.ha_sentinel_ports
        if other != port
    ]
    write_private(path, "\n".join(lines) + "\n")
    return path


def ha_argvs(settings: Settings) -> list[tuple[str, list[str]]]:
    """Each process of the HA Redis, named, in start order: the master, the replica, the
    Sentinels. Stopped in the reverse order: the Sentinels first, or they would fail over."""
    # Here, not at the top: the launcher reads ha_ports and needs none of redis_server's
    # imports (redis-py and the store).
    from exo_tasks.redis_server import find_redis_server, redis_server_argv

    master_port = current_master(settings)
    password_dir = settings.data_dir / "redis"
    members = []
    for port in server_ports(settings):
        argv = redis_server_argv(
            port, server_dir(settings, port), settings.redis_maxmemory_mb, password_dir
        )
        if port != master_port:
            argv += ["--replicaof", "127.0.0.1", str(master_port)]
        members.append((f"redis-{port}", argv))
    members.sort(key=lambda member: member[0] != f"redis-{master_port}")
    for port in settings.ha_sentinel_ports:
        conf = sentinel_conf(settings, port, master_port)
        members.append((f"sentinel-{port}", [find_redis_server(), str(conf), "--sentinel"]))
    return members
