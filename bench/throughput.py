"""Throughput and time to first token under 1, 8 and 32 clients, and warm vs cold, on the
`bench` model, for exo_tasks, mlx_lm.server and exo_tasks with batching off.

Each contender is started fresh for each client count (so no request of an earlier level is
still decoding) and stopped before the next one starts: contenders never share the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.clients import Client, CompletionsClient, ExoClient
from bench.config import Config
from bench.contenders import Lab, start_exo, start_mlx_server
from bench.load import closed_loop, sequential
from bench.results import EXO, MLX_SERVER, UNBATCHED, Results, percentile
from tests.support.processes import Processes

log = logging.getLogger("bench")
CONTENDERS = (EXO, MLX_SERVER, UNBATCHED)
# EXO_COMPLETION_BATCH_SIZE=1 and EXO_PREFILL_BATCH_SIZE=1: the runner serves one job at a time.
ONE_AT_A_TIME = {"completion_batch_size": 1, "prefill_batch_size": 1}
FIRST_TOKENS_TIMEOUT_S = 90.0


@dataclass
class Running:
    make_client: Callable[[], Client]
    processes: Processes


def start(lab: Lab, contender: str, model_dir: Path) -> Running:
    if contender == MLX_SERVER:
        server = start_mlx_server(lab, "mlx-server", model_dir)
        return Running(lambda: CompletionsClient(server.url), server.processes)
    settings = ONE_AT_A_TIME if contender == UNBATCHED else {}
    name = "exo-unbatched" if contender == UNBATCHED else "exo"
    stack = start_exo(lab, name, model_dir, **settings)
    return Running(lambda: ExoClient(stack.url, ignore_eos=True), stack.processes)


def run(lab: Lab, config: Config, results: Results) -> None:
    for clients in config.concurrency:
        for contender in CONTENDERS:
            log.info("throughput: %s, %d clients", contender, clients)
            running = start(lab, contender, config.bench_model)
            try:
                if contender != UNBATCHED:  # the same runner as exo_tasks: nothing new to see
                    _warm_and_cold(running, config, results, contender)
                if clients == 1:
                    _ttft_alone(running, config, results, contender)
                _under_load(running, config, results, contender, clients)
            finally:
                lab.stop(running.processes)


def _warm_and_cold(running: Running, config: Config, results: Results, contender: str) -> None:
    """The first job after the contender reports ready, then the second one."""
    first, second = sequential(running.make_client(), 2, config.probe_max_tokens, "probe")
    for name, trace in (("first job after start", first), ("second job", second)):
        if trace.latency_s is not None:
            results.sample("warm_cold", name, contender, "ms", trace.latency_s * 1000)


def _ttft_alone(running: Running, config: Config, results: Results, contender: str) -> None:
    client = running.make_client()
    for repeat in range(config.repeats):
        traces = sequential(client, config.ttft_requests, config.ttft_max_tokens, f"ttft {repeat}")
        ttfts = [t.ttft_s * 1000 for t in traces if t.ttft_s is not None]
        if ttfts:
            results.sample("ttft", "TTFT p50, 1 client", contender, "ms", percentile(ttfts, 50))
            results.sample("ttft", "TTFT p95, 1 client", contender, "ms", percentile(ttfts, 95))


def _under_load(
    running: Running, config: Config, results: Results, contender: str, clients: int
) -> None:
    # Under load, TTFT is compared between exo_tasks and mlx_lm.server only: with one job at a
    # time a request waits for every other client's whole job, minutes at 32 clients.
    ttft = clients > 1 and contender != UNBATCHED
    load = closed_loop(
        running.make_client,
        clients,
        max_tokens=config.max_tokens,
        windows=config.repeats,
        window_s=config.window_s,
        first_tokens_timeout_s=FIRST_TOKENS_TIMEOUT_S if ttft else 0.0,
    )
    level = f"{clients} client{'s' if clients > 1 else ''}"
    errors = 0
    for window in load.windows:
        stats = load.stats(window)
        errors += stats.errors
        results.sample(
            "throughput", f"tokens/s, {level}", contender, "tokens/s", stats.tokens_per_s
        )
        results.sample("throughput", f"jobs/s, {level}", contender, "jobs/s", stats.jobs_per_s)
        if ttft and stats.ttfts_s:
            ttfts = [t * 1000 for t in stats.ttfts_s]
            results.sample("ttft", f"TTFT p50, {level}", contender, "ms", percentile(ttfts, 50))
            results.sample("ttft", f"TTFT p95, {level}", contender, "ms", percentile(ttfts, 95))
    row = results.find("throughput", f"tokens/s, {level}", contender)
    if row is not None and (errors or load.short_jobs):
        row.note = f"{errors} failed requests, {load.short_jobs} jobs shorter than asked"
