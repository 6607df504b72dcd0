"""Section `instances`: the `bench` model as an instance over two ranks (workers `a` and `b` on
this machine, each rank its own process) against the same model whole in one runner and against
`mlx.launch --backend ring -n 2 ... mlx_lm.server` (mlx-lm's own distributed server): tokens/s
and TTFT at 1, 8 and 32 clients, and memory per rank: the bytes of parameters it holds, the MLX
memory its model uses (as the runner reports it: after loading, and its peak after the run at
the most clients) and its resident memory (which also counts the process's Python, MLX and
mlx-lm, the same in every runner whatever the model; mlx_lm.server reports no MLX memory).

Each contender is started fresh for each client count and stopped before the next one starts,
as in the throughput section. Two ranks on one 2-core machine share its cores: the instance is
measured here for what it costs, not for a speed-up (that needs a second machine).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psutil
import requests

from bench import throughput
from bench.clients import CompletionsClient, ExoClient
from bench.config import Config
from bench.contenders import (
    START_TIMEOUT_S,
    WORKER_CONCURRENCY,
    Lab,
    _get_ok,
    start_exo,
    start_mlx_server,
)
from bench.results import Op, Results, Target
from exo_tasks.fleet_types import RunnerState
from exo_tasks.naming import model_slug, runner_id_for
from exo_tasks.store import Store
from exo_tasks.types import utcnow
from tests.support.processes import EXO_TASKS, Processes, free_port, start_redis, wait_until
from tests.support.workers import start_worker, worker_env

log = logging.getLogger("bench")
SECTION = "instances"
INSTANCE = "exo_tasks instance, 2 ranks"
WHOLE = "exo_tasks, the model whole"
MLX_RING = "mlx_lm.server, mlx.launch ring -n 2"
HOSTS = ("a", "b")
MODEL_MEMORY = "MLX memory per rank, loaded"
# How long the runners get to finish the run's last jobs before their peak memory is read.
SETTLE_S = 60.0


def run(lab: Lab, config: Config, results: Results) -> None:
    for clients in config.concurrency:
        for contender in (INSTANCE, WHOLE, MLX_RING):
            log.info("instances: %s, %d clients", contender, clients)
            running, holders = _start(lab, contender, config)
            try:
                if clients == 1:
                    _memory_after_load(results, contender, holders)
                    throughput._ttft_alone(running, config, results, contender)
                began = utcnow()
                throughput._under_load(running, config, results, contender, clients)
                if clients == max(config.concurrency):
                    _peak_after_run(results, contender, holders, clients, began)
            finally:
                lab.stop(running.processes)


@dataclass
class Holders:
    """The processes that hold the model (one per rank), the most parameter bytes one of
    them holds (None: not reported), and their runners' states (exo_tasks only)."""

    pids: list[int]
    weights_bytes: int | None = None
    store: Store | None = None
    runner_ids: tuple[str, ...] = ()

    def runners(self) -> list[RunnerState]:
        if self.store is None:
            return []
        return [s for r in self.runner_ids if (s := self.store.runners.get(r)) is not None]


def _start(lab: Lab, contender: str, config: Config) -> tuple[throughput.Running, Holders]:
    """The contender, and what holds its model."""
    if contender == INSTANCE:
        return _start_instance(lab, config.bench_model, config.tiny_model)
    if contender == MLX_RING:
        return _start_mlx_ring(lab, config.bench_model)
    stack = start_exo(lab, "exo-whole", config.bench_model)
    runner = stack.store.runners.get(runner_id_for(stack.model, stack.workers[0].host))
    client = throughput.Running(lambda: ExoClient(stack.url, ignore_eos=True), stack.processes)
    assert runner is not None and runner.pid is not None
    return client, Holders([runner.pid], runner.weights_bytes, stack.store, (runner.id,))


def _start_instance(lab: Lab, model: Path, tiny: Path) -> tuple[throughput.Running, Holders]:
    """Redis, the API, workers a and b (serving the tiny model whole, as any host does), and
    an instance of `model` over a and b placed through the API; returns once it is Ready."""
    processes, directory = lab.group("exo-instance")
    redis = start_redis(processes, directory / "redis")
    port = free_port()
    settings = {"worker_concurrency": WORKER_CONCURRENCY}
    api_env = worker_env(redis.url, "api", [tiny], directory, api_port=port, **settings)
    processes.start([EXO_TASKS, "api"], api_env, directory / "api.log")
    for host in HOSTS:
        (directory / host).mkdir()
        start_worker(processes, redis.url, host, [tiny], directory / host, **settings)
    store = Store.from_url(redis.url)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: all(store.hosts.get(h) for h in HOSTS), START_TIMEOUT_S, "workers a, b")
    wait_until(lambda: _get_ok(f"{url}/healthz"), START_TIMEOUT_S, "the exo_tasks API")
    body = {"model": str(model), "hosts": list(HOSTS)}
    instance_id = requests.post(f"{url}/v1/instances", json=body, timeout=10).json()["id"]

    def ready() -> Holders | None:
        record = store.instances.get(instance_id)
        assert record is not None and record.status != "Failed", record
        pids = [r.pid for r in record.ranks if r.pid]
        weights = max(r.weights_bytes or 0 for r in record.ranks)
        up = record.status == "Ready" and len(pids) == len(HOSTS)
        ranks = tuple(r.runner_id for r in record.ranks)
        return Holders(pids, weights, store, ranks) if up else None

    holders: Holders = wait_until(ready, START_TIMEOUT_S, "the instance Ready", 0.5)
    slug = model_slug(str(model))
    client = throughput.Running(lambda: ExoClient(url, ignore_eos=True, model=slug), processes)
    return client, holders


def _start_mlx_ring(lab: Lab, model: Path) -> tuple[throughput.Running, Holders]:
    server = start_mlx_server(lab, "mlx-ring", model, ranks=2)
    ranks = [p.pid for p in _descendants(server.processes) if "mlx_lm" in " ".join(p.cmdline())]
    client = throughput.Running(lambda: CompletionsClient(server.url), server.processes)
    return client, Holders(ranks)


def _descendants(processes: Processes) -> list[psutil.Process]:
    found: list[psutil.Process] = []
    for started in processes.started:
        try:
            found += psutil.Process(started.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            continue
    return found


def _memory_after_load(results: Results, contender: str, holders: Holders) -> None:
    """Per rank (the largest), once loaded: the bytes of parameters it holds, the MLX memory
    its model uses, and its resident memory. The resident memory also counts the process's
    Python, MLX and mlx-lm (120-150 MiB a runner here), which no split shares out: on the small
    bench model that is most of it."""
    sizes = []
    for pid in holders.pids:
        try:
            sizes.append(psutil.Process(pid).memory_info().rss / 2**20)
        except psutil.NoSuchProcess:
            continue
    if sizes:
        results.sample(SECTION, "resident memory per rank", contender, "MiB", max(sizes))
    if holders.weights_bytes:
        weights = holders.weights_bytes / 2**20
        results.sample(SECTION, "weights per rank", contender, "MiB", weights)
    used = [r.memory_bytes for r in holders.runners() if r.memory_bytes is not None]
    if used:
        results.sample(SECTION, MODEL_MEMORY, contender, "MiB", max(used) / 2**20)


def _peak_after_run(
    results: Results, contender: str, holders: Holders, clients: int, began: datetime
) -> None:
    """Per rank (the largest): the most MLX memory it used, its KV caches at the most clients
    included (each rank holds its share of the attention heads' keys and values), as each
    runner published it once its batch emptied after the run `began`."""

    deadline = time.monotonic() + SETTLE_S
    states = holders.runners()
    while not all(not r.active_jobs and r.updated_at > began for r in states):
        if time.monotonic() > deadline:  # a loaded machine: what they last published
            log.warning("instances: runners still busy %.0fs after the run", SETTLE_S)
            break
        time.sleep(0.5)
        states = holders.runners()
    peaks = [r.peak_memory_bytes for r in states if r.peak_memory_bytes is not None]
    if peaks:
        row = f"MLX peak memory per rank, {clients} clients"
        results.sample(SECTION, row, contender, "MiB", max(peaks) / 2**20)


def set_targets(results: Results) -> None:
    """Issue 28's: at 32 clients >= 1.0x the distributed mlx_lm.server; the parameters a rank
    holds <= 0.6x the whole model's runner's (resident memory is reported beside them)."""
    pairs: tuple[tuple[str, str, Op, float, str], ...] = (
        ("tokens/s, 32 clients", MLX_RING, ">=", 1.0, "instance tokens/s at 32 clients"),
        ("weights per rank", WHOLE, "<=", 0.6, "instance weights per rank"),
        (MODEL_MEMORY, WHOLE, "<=", 0.6, "instance model memory per rank"),
    )
    for row, reference, op, bound, name in pairs:
        section = "throughput" if row.startswith("tokens") else SECTION
        measured, ref = results.find(section, row, INSTANCE), results.find(section, row, reference)
        if measured is not None and ref is not None and measured.samples and ref.samples:
            target = f"{name} {op} {bound}x {reference}"
            results.targets.append(Target(target, measured, ref, op, bound))
