"""Instances for tests and benchmarks: two workers (hosts `a` and `b`, each its own process
tree and ring port) on one Redis, an instance of a model over both, and the waits and probes
the runtime's tests share."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from exo_tasks.instances import InstanceRecord, InstanceStatus
from exo_tasks.modelgen import create_model
from exo_tasks.store import Store
from tests.support.api import Api, api_settings, serving
from tests.support.processes import Processes, has_exited, wait_until
from tests.support.workers import Worker, start_worker

HOSTS = ("a", "b")
# Loading two ranks and forming the ring took 16 s on the loaded 2-core test machine.
START_TIMEOUT_S = 120.0


@dataclass
class Pair:
    """Two workers on one Redis, and the instance placed over them."""

    redis_url: str
    store: Store
    workers: dict[str, Worker]
    instance_id: str
    data_dir: Path
    models: list[Path]
    processes: Processes  # the pair's own: a worker started again lives as long as the pair
    api: Api

    def instance(self) -> InstanceRecord:
        record = self.store.instances.get(self.instance_id)
        assert record is not None
        return record

    def explain(self, record: InstanceRecord) -> str:
        """Why the instance is not Ready, for an assertion: its error, and the end of each
        worker's log (a hung rank's stacks are there)."""
        logs = [f"--- worker {h} ---\n{w.log_text()[-4000:]}" for h, w in self.workers.items()]
        return "\n".join([f"{record.status}: {record.error}", *logs])

    def rank_pid(self, rank: int) -> int:
        pid = self.instance().ranks[rank].pid
        assert pid is not None
        return pid

    def wait_ready(self, after_generation: int = 0) -> InstanceRecord:
        """The instance Ready in a generation after `after_generation`, every worker alive."""

        def ready() -> InstanceRecord | None:
            for worker in self.workers.values():
                assert worker.process.poll() is None, worker.log_text()[-4000:]
            record = self.instance()
            fresh = record.generation > after_generation and record.status is InstanceStatus.READY
            return record if fresh and all(r.pid for r in record.ranks) else None

        found: InstanceRecord = wait_until(ready, START_TIMEOUT_S, "the instance Ready", 0.2)
        return found

    def wait_status(self, status: InstanceStatus, timeout_s: float) -> InstanceRecord:
        found: InstanceRecord = wait_until(
            lambda: (r := self.instance()).status is status and r, timeout_s, f"instance {status}"
        )
        return found

    def shut_down(self, mode: str) -> None:
        path = f"/v1/instances/{self.instance_id}/shutdown"
        response = self.api.post(path, json={"mode": mode})
        assert response.status_code == 202, response.text

    def place_again(self) -> None:
        record = self.instance()
        body = {"model": record.model_path, "hosts": record.hosts, "parallel": record.parallel}
        response = self.api.post("/v1/instances", json=body)
        assert response.status_code == 202, response.text

    def restart_worker(self, host: str) -> Worker:
        worker = start_worker(
            self.processes, self.redis_url, host, self.models, self.data_dir / host
        )
        self.workers[host] = worker
        return worker


@contextlib.contextmanager
def running_pair(redis_url: str, store: Store, data_dir: Path, model: Path) -> Iterator[Pair]:
    """Workers a and b, each serving `whole` (the `chat` preset under another name, whole: the
    model the instance's texts are compared with), the API, and an instance of `model` over
    a and b placed through it, Ready. Every process is stopped at the end of the block."""
    processes = Processes()
    whole = create_model("chat", data_dir / "whole")
    try:
        workers = {}
        for host in HOSTS:
            (data_dir / host).mkdir(parents=True, exist_ok=True)
            workers[host] = start_worker(processes, redis_url, host, [whole], data_dir / host)
        wait_until(lambda: all(store.hosts.get(h) for h in HOSTS), 90, "both hosts' heartbeats")
        with serving(api_settings(redis_url, [whole])) as api:
            placed = place(api, model)
            pair = Pair(redis_url, store, workers, placed, data_dir, [whole], processes, api)
            pair.wait_ready()
            yield pair
    finally:
        processes.stop_all()
        # The same placement in a later module is the same instance id: it must start anew,
        # not be found Ready with this pair's dead ranks.
        for record in store.instances.all():
            if record.hosts[0] in HOSTS:
                store.instances.remove(record.id)


def place(api: Api, model: Path, hosts: tuple[str, ...] = HOSTS) -> str:
    """An instance of `model` over `hosts`, placed through the API; its id."""
    body = {"model": str(model), "hosts": list(hosts), "parallel": "tensor"}
    response = api.post("/v1/instances", json=body)
    assert response.status_code == 202, response.text
    instance_id: str = response.json()["id"]
    return instance_id


def pids_and_ports(record: InstanceRecord) -> tuple[list[int], list[int]]:
    """Each rank's process and ring port, in rank order."""
    pids = [r.pid for r in record.ranks]
    ports = [r.port for r in record.ranks]
    assert all(pids) and all(ports), record.ranks
    return [p for p in pids if p], [p for p in ports if p]


def wait_gone(pid: int, timeout_s: float, what: str) -> float:
    """Seconds until process `pid` has exited (fails after `timeout_s`)."""
    started = time.monotonic()
    wait_until(lambda: has_exited(pid), timeout_s, what, 0.02)
    return time.monotonic() - started


def listening(port: int) -> bool:
    """Whether a process on this machine still holds `port` (listening or connected from it;
    a connection the kernel keeps in TIME_WAIT after its process exited is no process's)."""
    return any(
        c.laddr and c.laddr.port == port and c.pid is not None
        for c in psutil.net_connections("tcp")
    )


def submit(pair: Pair, **body: Any) -> str:
    """A job for the instance's model, through POST /v1/jobs (the model is served by no host
    whole: its jobs go to the instance)."""
    return pair.api.submit(model=pair.instance().model, **body)
