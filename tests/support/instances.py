"""Instances for tests and benchmarks: two workers (hosts `a` and `b`, each its own process
tree and ring port) on one Redis, an instance of a model over both, and the waits and probes
the runtime's tests share."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from exo_tasks.instances import InstanceRecord, InstanceStatus, shutdown
from exo_tasks.store import Store
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

    def instance(self) -> InstanceRecord:
        record = self.store.get_instance(self.instance_id)
        assert record is not None
        return record

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
        assert mode in ("warm", "hard")
        assert self.store.apply_instance_move(shutdown(self.instance(), mode))  # type: ignore[arg-type]

    def restart_worker(self, host: str) -> Worker:
        worker = start_worker(
            self.processes, self.redis_url, host, self.models, self.data_dir / host
        )
        self.workers[host] = worker
        return worker


def start_pair(
    processes: Processes, redis_url: str, store: Store, data_dir: Path, whole: Path, model: Path
) -> Pair:
    """Workers a and b serving `whole` (a model of their own, whole), and an instance of
    `model` over both, Ready."""
    workers = {}
    for host in HOSTS:
        (data_dir / host).mkdir(parents=True, exist_ok=True)
        workers[host] = start_worker(processes, redis_url, host, [whole], data_dir / host)
    wait_until(lambda: all(store.get_host(h) for h in HOSTS), 90, "both hosts' heartbeats")
    record, _ = store.place_instance(InstanceRecord.placed(str(model), list(HOSTS), "tensor"))
    pair = Pair(redis_url, store, workers, record.id, data_dir, [whole], processes)
    pair.wait_ready()
    return pair


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


def submit(pair: Pair, **body: object) -> str:
    """A job for the instance, sent to its queue as the API's routing sends it."""
    from exo_tasks import jobs
    from exo_tasks.celery_app import ExoCelery
    from exo_tasks.naming import instance_queue
    from exo_tasks.types import JobRequest
    from tests.support.api import api_settings

    settings = api_settings(pair.redis_url, pair.models)
    record = pair.instance()
    request = JobRequest.model_validate({**body, "model": record.model})
    where = jobs.Route(model=record.model, queue=instance_queue(record.id))
    return jobs.submit(pair.store, ExoCelery(settings), settings, request, where=where).id
