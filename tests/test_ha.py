"""Redis without a single point of failure (issue 30): the HA stack's own Redis (a master, a
replica, three Sentinels from the embedded binary), and a whole `exo-tasks up --ha` stack whose
master is SIGKILLed under load. Real processes, real signals, default settings."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import redis
import requests

from exo_tasks.batch.jobs import line_job_id
from exo_tasks.redis_auth import redis_password
from exo_tasks.redis_ha import server_dir
from exo_tasks.redis_server import redis_server_argv, wait_for_redis
from exo_tasks.replication import replicated
from exo_tasks.store import Store, connect
from tests.support import sse
from tests.support.batches import CHAT_URL, chat_line, jsonl
from tests.support.ha import ha_settings, master_port, sentinel_client, server_process, settings_of
from tests.support.launcher import LocalStack, launcher_env
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
    _measure_replication(connect(url), replica, server_process(proc.pid, settings.redis_port + 1))

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
    # Each Sentinel knows the replica and the other two from its start, not 2-10 s later: a
    # master lost before they had met was never failed over (CI on a loaded machine).
    name = settings.redis_master_name
    password = redis_password(settings.data_dir / "redis")  # the Sentinels' too
    for port in settings.ha_sentinel_ports:
        wait_for_redis(f"redis://:{password}@127.0.0.1:{port}", timeout_s=10)
        sentinel = sentinel_client(settings, port)
        others = {int(other["port"]) for other in sentinel.sentinel_sentinels(name)}
        assert others == set(settings.ha_sentinel_ports) - {port}
        replicas = [int(replica["port"]) for replica in sentinel.sentinel_slaves(name)]
        assert replicas == [settings.redis_port + 1]
    first_sentinel = server_process(proc.pid, settings.ha_sentinel_ports[0], sentinel=True)
    first_sentinel.send_signal(signal.SIGKILL)  # the one every client asks first
    client = connect(url)
    started = time.monotonic()
    client.set("after the Sentinel", "1")
    lookup_s = time.monotonic() - started
    print(f"a write with the first Sentinel gone: {lookup_s * 1e3:.1f} ms")
    assert lookup_s < 0.5  # the next Sentinel at once, not the dead one retried

    # On the replica (once it is attached) before the kill: else the master may take it along.
    wait_until(lambda: replicated(client, 1000), 10, "the write on the replica")
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

    # Started again, the HA Redis keeps the promoted server as its master, the other its replica.
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=5) == 0
    again = processes.start([EXO_TASKS, "redis"], exo_env(**values), tmp_path / "again.log")
    wait_for_redis(url, timeout_s=10)
    client = connect(url)
    assert client.info("server")["tcp_port"] == settings.redis_port + 1
    assert client.get("after the master") == "1"
    password = redis_password(settings.data_dir / "redis")
    wait_until(lambda: _role(settings.redis_port, password) == "slave", 10, "the other a replica")
    # Once it answers: until then its title may still be its command line, not its address.
    assert server_process(again.pid, settings.redis_port).is_running()


def _measure_replication(master: Any, replica: Any, replica_process: psutil.Process) -> None:
    """The loss window of asynchronous replication (how long a write is on the master alone)
    and what waiting for a replica costs; a replica that stops answering is waited for no
    longer than the bound, one that is gone not at all."""
    lags, waits = [], []
    for i in range(200):
        master.set("lag", i)
        written = time.perf_counter()
        while replica.get("lag") != str(i):
            pass
        lags.append(time.perf_counter() - written)
        started = time.perf_counter()
        assert replicated(master, 500)
        waits.append(time.perf_counter() - started)
    lags.sort()
    waits.sort()
    print(
        f"replication lag over 200 writes: p50 {lags[100] * 1e3:.2f} ms, max "
        f"{lags[-1] * 1e3:.2f} ms; a 202's wait for a replica: p50 {waits[100] * 1e3:.2f} ms, "
        f"max {waits[-1] * 1e3:.2f} ms"
    )
    replica_process.send_signal(signal.SIGSTOP)
    try:
        started = time.perf_counter()
        assert not replicated(master, 300)
        assert 0.25 < time.perf_counter() - started < 1.0
    finally:
        replica_process.send_signal(signal.SIGCONT)
    # A replica lost: the master goes on, and says at once that nothing is replicated.
    replica_process.send_signal(signal.SIGKILL)
    wait_until(lambda: not master.role()[2], 5, "the master to drop its replica")
    started = time.perf_counter()
    assert not replicated(master, 5_000) and master.set("alone", "1")
    # At once, not after the 5 s wait: two round trips (up to 0.4 s seen in a loaded suite, so
    # the wait is long enough that no load passes for it).
    assert time.perf_counter() - started < 2.5


# Long enough to run through the kill: the `tiny` model decodes 8 jobs of 300 tokens in the
# ~2 s the shorter ones take to be sent, on a 2-core machine that is busy besides.
JOB = {"prompt": "failover", "max_tokens": 1500, "ignore_eos": True}
SHORT_JOB = {**JOB, "max_tokens": 20}
# The worker's pool has 8 children (launcher_env): 8 long jobs run through the kill, 42 short
# ones wait behind them, and a batch's lines behind those (priority `low`): the feeder has sent
# 6 (8 children less 2 kept for interactive jobs) at the kill, the rest it sends after it.
LONG_JOBS, SHORT_JOBS = 8, 42
BATCH_LINES = 16
STREAMED = (0, LONG_JOBS, -1)  # streams open at the kill: a running job, two queued ones
FIRST_ACCEPT_TARGET_S = 10.0
QUEUE_ROW = re.compile(
    r'<tr id="[^"]+">\s*<td>[^<]+</td>\s*<td class="broker-secondary-column">\d+</td>'
)


def _stream(api: str, job_id: str, into: list[dict[str, Any]]) -> None:
    """The job's events up to its `done`, as a client reads them: after an `error` event (Redis
    lost at a moment the stream could not wait it out) it resumes from the last event it got."""
    while not into or into[-1]["event"] != "done":
        last = next((event["id"] for event in reversed(into) if event["id"]), None)
        headers = {"Last-Event-ID": last} if last else {}
        url = f"{api}/v1/jobs/{job_id}/stream"
        with requests.get(url, headers=headers, stream=True, timeout=30) as response:
            if response.status_code == 503:
                time.sleep(int(response.headers["Retry-After"]))
                continue
            for event in sse.read(response):
                into.append(event)
                if event["event"] in ("done", "error"):
                    break


def _post(api: str, job: dict[str, Any]) -> requests.Response:
    reply = requests.post(f"{api}/v1/jobs", json=job, timeout=10)
    assert reply.status_code == 202, reply.text
    return reply


def _ended_streams(streams: list[list[dict[str, Any]]]) -> bool:
    return all(events and events[-1]["event"] == "done" for events in streams)


def _submit_through_the_gap(api: str, killed: float) -> tuple[requests.Response, int]:
    """Submit until a job is accepted: every refusal a 503 with Retry-After, none a 500 or a
    hang, /healthz up all along. Returns the 202 and how many 503 came before it."""
    refused = 0
    while True:
        reply = requests.post(f"{api}/v1/jobs", json={**JOB, "max_tokens": 20}, timeout=10)
        if reply.status_code == 202:
            return reply, refused
        assert reply.status_code == 503, reply.text
        assert int(reply.headers["Retry-After"]) > 0
        refused += 1
        assert requests.get(f"{api}/healthz", timeout=5).status_code == 200
        ready = requests.get(f"{api}/readyz", timeout=5)
        assert ready.status_code == 200 or ready.json()["status"], ready.text
        assert time.monotonic() - killed < 60, "no master after a minute"
        time.sleep(0.2)


def _unended(store: Store, ids: list[str]) -> int:
    return sum(job is None or not job.is_terminal for job in store.jobs.records(ids))


def _create_batch(api: str, lines: list[dict[str, Any]]) -> tuple[str, bool]:
    """A batch of `lines` (its file uploaded, then the batch created); its id, and whether
    both answers said a replica holds them."""
    files = {"file": ("input.jsonl", jsonl(lines))}
    uploaded = requests.post(f"{api}/v1/files", data={"purpose": "batch"}, files=files, timeout=10)
    assert uploaded.status_code == 200, uploaded.text
    body = {
        "input_file_id": uploaded.json()["id"],
        "endpoint": CHAT_URL,
        "completion_window": "24h",
    }
    created = requests.post(
        f"{api}/v1/batches", json={**body, "completion_window": "24h"}, timeout=10
    )
    assert created.status_code == 200, created.text
    replicated = all("Exo-Replicated" not in r.headers for r in (uploaded, created))
    return created.json()["id"], replicated


def _batch_results(api: str, batch_id: str) -> list[dict[str, Any]]:
    """The completed batch's output lines, once it has ended."""

    def ended() -> dict[str, Any] | None:
        batch: dict[str, Any] = requests.get(f"{api}/v1/batches/{batch_id}", timeout=5).json()
        return batch if batch["status"] in ("completed", "failed", "cancelled") else None

    batch = wait_until(ended, 60, f"batch {batch_id} to end", interval_s=0.2)
    assert batch["status"] == "completed" and batch["error_file_id"] is None, batch
    output = requests.get(f"{api}/v1/files/{batch['output_file_id']}/content", timeout=5)
    return [json.loads(line) for line in output.text.splitlines()]


def _replicated_job(api: str, ids: list[str]) -> bool:
    """Submit a job (its id to `ids`); whether its answer says a replica holds it."""
    reply = _post(api, SHORT_JOB)
    ids.append(reply.json()["id"])
    return "Exo-Replicated" not in reply.headers


def _role(port: int, password: str) -> str | None:
    try:
        role: str = redis.Redis(port=port, password=password).info("replication")["role"]
        return role
    except redis.ConnectionError:
        return None


def test_killing_the_master_under_load_costs_seconds_not_jobs(
    processes: Processes, tmp_path: Path, tiny_model: Path
) -> None:
    data_dir = tmp_path / "var"
    values = ha_settings(data_dir)
    ha = {name: value for name, value in values.items() if name != "data_dir"}
    env = launcher_env(data_dir, models=tiny_model, **ha)
    stack = LocalStack(processes, data_dir, env, tmp_path / "stack.log")
    stack.start([EXO_TASKS, "up", "--ha"])
    settings = settings_of(values)
    store = Store.from_url(settings.effective_redis_url)
    replies = [_post(stack.api, JOB) for _ in range(LONG_JOBS)]  # first, to the free children
    with ThreadPoolExecutor(8) as senders:
        replies += senders.map(lambda job: _post(stack.api, job), [SHORT_JOB] * SHORT_JOBS)
    assert all("Exo-Replicated" not in r.headers for r in replies)  # a replica held each
    ids = [reply.json()["id"] for reply in replies]
    lines = [
        chat_line(f"line-{n}", "hi", max_tokens=16, ignore_eos=True) for n in range(BATCH_LINES)
    ]
    batch_id, replicated = _create_batch(stack.api, lines)
    assert replicated  # the file and the batch were on a replica before their answers
    streams: list[list[dict[str, Any]]] = [[] for _ in STREAMED]
    for events, index in zip(streams, STREAMED, strict=True):
        args = (stack.api, ids[index], events)
        threading.Thread(target=_stream, args=args, daemon=True).start()
    wait_until(lambda: len(streams[0]) >= 3, 20, "tokens of the first job, streamed")
    wait_until(lambda: store.batches.inflight(batch_id), 20, "the batch's first lines sent")
    in_flight = [line_job_id(batch_id, line) for line in store.batches.inflight(batch_id)]
    assert _unended(store, ids + in_flight) >= 50
    assert store.batches.cursor(batch_id) < BATCH_LINES  # the batch is being fed
    tree = stack.tree()
    old_port = master_port(settings)
    master = server_process(tree[0].pid, old_port)
    others = [p for p in tree if p.pid != master.pid and "redis-server" not in p.name()]

    master.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    reply, refused = _submit_through_the_gap(stack.api, killed)
    first_accept_s = time.monotonic() - killed
    # The new master has no replica now: what it accepts is accepted, and the answer says so.
    assert reply.headers.get("Exo-Replicated") == "false"
    ids.append(reply.json()["id"])
    late_batch_id, replicated = _create_batch(stack.api, lines[:1])
    assert not replicated
    wait_until(lambda: not _unended(store, ids), 60, "every accepted job to end")
    drained_s = time.monotonic() - killed
    results = _batch_results(stack.api, batch_id)
    batch_done_s = time.monotonic() - killed
    print(
        f"master SIGKILLed: first job accepted again after {first_accept_s:.2f}s ({refused} "
        f"answers 503 before), every job ended after {drained_s:.2f}s, the batch after "
        f"{batch_done_s:.2f}s"
    )
    # Every line has its one result; every job, the batch's too, ended once and whole.
    assert sorted(r["custom_id"] for r in results) == sorted(line["custom_id"] for line in lines)
    assert all(r["response"]["status_code"] == 200 for r in results), results
    assert len(_batch_results(stack.api, late_batch_id)) == 1
    for job_id in ids + [line_job_id(batch_id, n) for n in range(BATCH_LINES)]:
        job = stack.job(job_id)
        assert job["status"] == "succeeded", job
        assert job["usage"]["completion_tokens"] == job["request"]["max_tokens"], job
        dones = [e for _, e in store.streams.read_events(job_id) if e.event == "done"]
        assert len(dones) == 1, (job_id, dones)
    # The lines the feeder sent after the kill were on the new master alone, and it said so.
    assert "lines accepted on the master alone" in stack.log_text()
    wait_until(lambda: _ended_streams(streams), 10, "every stream to its end")
    for events in streams:  # each went on (or resumed) to its end, its tokens in order
        indexes = [e["data"]["index"] for e in events if e["event"] == "token"]
        assert indexes == sorted(set(indexes)), indexes
    errors = sum(e["event"] == "error" for events in streams for e in events)
    print(f"{len(streams)} streams open at the kill ended whole; {errors} resumed after an error")
    # Nothing was restarted: every process of the stack but the killed master still runs.
    assert [p.pid for p in others if has_exited(p.pid)] == []
    assert first_accept_s < FIRST_ACCEPT_TARGET_S

    # The old master, started again as it was, is made a replica of the new one by the
    # Sentinels; a write it took before that does not survive (no split brain).
    password = redis_password(data_dir / "redis")
    argv = redis_server_argv(
        old_port, server_dir(settings, old_port), settings.redis_maxmemory_mb, data_dir / "redis"
    )
    processes.start(argv, dict(os.environ), tmp_path / "old-master.log")
    restarted = time.monotonic()
    old = redis.Redis(port=old_port, password=password)
    wait_until(lambda: _role(old_port, password), 10, "the old master up again")
    with contextlib.suppress(redis.ReadOnlyError):  # a replica already
        old.set("split-brain", "written on the old master")
    wait_until(lambda: _role(old_port, password) == "slave", 30, "the old master a replica")
    wait_until(lambda: old.get("split-brain") is None, 10, "the old master's write gone")
    assert store.redis.get("split-brain") is None
    wait_until(lambda: _replicated_job(stack.api, ids), 10, "a job replicated again", 0.5)
    wait_until(lambda: not _unended(store, ids), 30, "the last job to end")
    print(f"the old master, started again, a replica {time.monotonic() - restarted:.2f}s later")

    # Flower's Broker tab finds the new master through the Sentinels too, even with the one its
    # broker URL names first gone: a queue's row with its length read from the broker. (Which
    # queues it lists depends on whether its inspection of the workers answered: theirs, or
    # else Celery's default `celery`.)
    server_process(tree[0].pid, settings.ha_sentinel_ports[0], sentinel=True).kill()
    flower = requests.get(f"http://127.0.0.1:{env['EXO_FLOWER_PORT']}/broker", timeout=10)
    assert flower.status_code == 200 and QUEUE_ROW.search(flower.text), flower.text[-2000:]

    # Ctrl-C stops the whole HA stack in its order: worker, api and flower, Sentinels, servers.
    assert stack.process is not None
    stack.process.send_signal(signal.SIGINT)
    assert stack.process.wait(timeout=15) == 0
    wait_until(lambda: all(has_exited(p.pid) for p in tree), 5, "every process of the stack")
    assert "SIGKILL" not in stack.log_text()
