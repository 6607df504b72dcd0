"""Section `instances`: the `bench` model as an instance over two ranks (workers `a` and `b` on
this machine, each rank its own process) against the same model whole in one runner and against
`mlx.launch --backend ring -n 2 ... mlx_lm.server` (mlx-lm's own distributed server): tokens/s
and TTFT at 1, 8 and 32 clients, and resident memory per rank.

Each contender is started fresh for each client count and stopped before the next one starts,
as in the throughput section. Two ranks on one 2-core machine share its cores: the instance is
measured here for what it costs, not for a speed-up (that needs a second machine).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import psutil
import requests

from bench import throughput
from bench.clients import ExoClient, MlxServerClient
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
from exo_tasks.naming import model_slug, runner_id_for
from exo_tasks.store import Store
from tests.support.processes import EXO_TASKS, Processes, free_port, start_redis, wait_until
from tests.support.workers import start_worker, worker_env

log = logging.getLogger("bench")
SECTION = "instances"
INSTANCE = "exo_tasks instance, 2 ranks"
WHOLE = "exo_tasks, the model whole"
MLX_RING = "mlx_lm.server, mlx.launch ring -n 2"
HOSTS = ("a", "b")


def run(lab: Lab, config: Config, results: Results) -> None:
    for clients in config.concurrency:
        for contender in (INSTANCE, WHOLE, MLX_RING):
            log.info("instances: %s, %d clients", contender, clients)
            running, holders = _start(lab, contender, config)
            try:
                if clients == 1:
                    _memory(results, contender, holders)
                    throughput._ttft_alone(running, config, results, contender)
                throughput._under_load(running, config, results, contender, clients)
            finally:
                lab.stop(running.processes)


@dataclass
class Holders:
    """The processes that hold the model (one per rank), and the most parameter bytes one of
    them holds (None: not reported)."""

    pids: list[int]
    weights_bytes: int | None = None


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
    return client, Holders([runner.pid], runner.weights_bytes)


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
        return Holders(pids, weights) if up else None

    holders: Holders = wait_until(ready, START_TIMEOUT_S, "the instance Ready", 0.5)
    slug = model_slug(str(model))
    client = throughput.Running(lambda: ExoClient(url, ignore_eos=True, model=slug), processes)
    return client, holders


def _start_mlx_ring(lab: Lab, model: Path) -> tuple[throughput.Running, Holders]:
    server = start_mlx_server(lab, "mlx-ring", model, ranks=2)
    ranks = [p.pid for p in _descendants(server.processes) if "mlx_lm" in " ".join(p.cmdline())]
    client = throughput.Running(lambda: MlxServerClient(server.url), server.processes)
    return client, Holders(ranks)


def _descendants(processes: Processes) -> list[psutil.Process]:
    found: list[psutil.Process] = []
    for started in processes.started:
        try:
            found += psutil.Process(started.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            continue
    return found


def _memory(results: Results, contender: str, holders: Holders) -> None:
    """Per rank (the largest): resident memory, and the bytes of parameters it holds. The
    resident memory counts Python and MLX too (about 300 MiB a process here), which a rank does
    not split: on the small bench model that dominates."""
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


def set_targets(results: Results) -> None:
    """Issue 28's: at 32 clients >= 1.0x the distributed mlx_lm.server; the parameters a rank
    holds <= 0.6x the whole model's runner's (resident memory is reported beside them)."""
    pairs: tuple[tuple[str, str, Op, float, str], ...] = (
        ("tokens/s, 32 clients", MLX_RING, ">=", 1.0, "instance tokens/s at 32 clients"),
        ("weights per rank", WHOLE, "<=", 0.6, "instance weights per rank"),
    )
    for row, reference, op, bound, name in pairs:
        section = SECTION if row.startswith("weights") else "throughput"
        measured, ref = results.find(section, row, INSTANCE), results.find(section, row, reference)
        if measured is not None and ref is not None and measured.samples and ref.samples:
            target = f"{name} {op} {bound}x {reference}"
            results.targets.append(Target(target, measured, ref, op, bound))
