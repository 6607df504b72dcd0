"""Redis without a single point of failure (issue 30): the HA stack's own Redis (a master, a
replica, three Sentinels from the embedded binary), and a whole `exo-tasks up --ha` stack whose
master is SIGKILLed under load. Real processes, real signals, default settings."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import redis

from exo_tasks.redis_server import wait_for_redis
from exo_tasks.store import connect
from tests.support.ha import ha_settings, sentinel_client, server_process, settings_of
from tests.support.processes import EXO_TASKS, Processes, exo_env, has_exited, wait_until


def test_the_ha_redis_replicates_and_stops_its_sentinels_first(
    processes: Processes, tmp_path: Path
) -> None:
    values = ha_settings(tmp_path / "var")
    settings = settings_of(values)
    log_path = tmp_path / "redis.log"
    proc = processes.start([EXO_TASKS, "redis"], exo_env(**values), log_path)
    url = settings.effective_redis_url
    wait_for_redis(url, timeout_s=10)  # through the Sentinels
    connect(url).set("written", "on the master")
    assert settings.sentinels is not None and settings.sentinels.password is not None
    replica = redis.Redis(
        port=settings.redis_port + 1,
        password=settings.sentinels.password.get_secret_value(),
        decode_responses=True,
    )
    assert replica.info("replication")["role"] == "slave"
    wait_until(lambda: replica.get("written") == "on the master", 5, "the write on the replica")

    def every_sentinel_sees_all() -> bool:
        for port in settings.ha_sentinel_ports:
            master = sentinel_client(settings, port).sentinel_master(settings.redis_master_name)
            if (master["port"], master["num-slaves"], master["num-other-sentinels"]) != (
                settings.redis_port,
                1,
                2,
            ):
                return False
        return True

    wait_until(every_sentinel_sees_all, 10, "three Sentinels agreeing on master and replica")
    members = psutil.Process(proc.pid).children()  # (a server may have an AOF rewrite child)
    assert len(members) == 5, [p.cmdline() for p in members]
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]

    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=5) == 0
    wait_until(lambda: all(has_exited(p.pid) for p in tree), 5, "every process of the HA Redis")
    print(f"HA Redis stopped in {time.monotonic() - started:.2f}s")
    log = log_path.read_text()
    # The Sentinels went first: none saw the master go down, none failed over.
    assert "+sdown master" not in log and "+switch-master" not in log, log[-3000:]
    last_sentinel_bye = log.rindex("Sentinel is now ready to exit")
    assert log.index("Redis is now ready to exit") > last_sentinel_bye


def test_a_sentinel_lost_costs_nothing_and_two_still_fail_over(
    processes: Processes, tmp_path: Path
) -> None:
    values = ha_settings(tmp_path / "var")
    settings = settings_of(values)
    proc = processes.start([EXO_TASKS, "redis"], exo_env(**values), tmp_path / "redis.log")
    url = settings.effective_redis_url
    wait_for_redis(url, timeout_s=10)
    first_sentinel = server_process(proc.pid, settings.ha_sentinel_ports[0], sentinel=True)
    first_sentinel.send_signal(signal.SIGKILL)  # the one every client asks first
    client = connect(url)
    started = time.monotonic()
    client.set("after the Sentinel", "1")
    lookup_s = time.monotonic() - started
    print(f"a write with the first Sentinel gone: {lookup_s * 1e3:.1f} ms")
    assert lookup_s < 0.5  # the next Sentinel at once, not the dead one retried

    server_process(proc.pid, settings.redis_port).send_signal(signal.SIGKILL)
    killed = time.monotonic()

    def written() -> bool:
        try:
            return bool(client.set("after the master", "1"))
        except redis.ConnectionError:
            return False

    wait_until(written, 30, "a write on the new master", interval_s=0.1)
    print(f"two Sentinels failed over in {time.monotonic() - killed:.2f}s")
    assert client.info("server")["tcp_port"] == settings.redis_port + 1
    assert client.get("after the Sentinel") == "1"
