"""The queue's overhead on the `tiny` model: a 1-token job through the HTTP API (submit, then
stream until done; and as an OpenAI client sends it, one streamed `POST /v1/completions`)
against `mlx_lm.stream_generate` in process for the same prompts; beside it, what Celery itself
costs on the same Redis (bench/celery_noop.py), and the issue's target (issue 32): the 1-token
job's queue overhead p50 at most 1.5x that bare round trip."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from bench import celery_noop
from bench.clients import Client, CompletionsClient, ExoClient
from bench.config import Config
from bench.contenders import Lab, start_exo
from bench.load import sequential
from bench.results import CELERY, EXO, EXO_OPENAI, IN_PROCESS, Results, Target, percentile

log = logging.getLogger("bench")
SECTION = "overhead"


def run(lab: Lab, config: Config, results: Results) -> None:
    baseline = in_process(config)
    log.info("overhead: %s, 1-token jobs", EXO)
    stack = start_exo(lab, "exo-overhead", config.tiny_model)
    clients: dict[str, Client] = {
        EXO: ExoClient(stack.url, ignore_eos=True),
        EXO_OPENAI: CompletionsClient(stack.url),
    }
    queued: dict[str, list[list[float]]] = {contender: [] for contender in clients}
    try:
        for contender, client in clients.items():
            sequential(client, 3, 1, f"warmup {contender}")  # connections, first-use paths
        celery_noop.start_worker(stack.processes, stack.redis.url, stack.directory / "noop.log")
        celery_noop.round_trips_ms(stack.redis.url, 3)  # warmup
        for repeat in range(config.repeats):
            for contender, client in clients.items():
                traces = sequential(client, config.overhead_jobs, 1, f"{contender} {repeat}")
                queued[contender].append(
                    [t.latency_s * 1000 for t in traces if t.latency_s is not None]
                )
            # Side by side: the bare round trip right after each round of jobs.
            bare = percentile(celery_noop.round_trips_ms(stack.redis.url, config.overhead_jobs), 50)
            results.sample(SECTION, "bare Celery round trip p50", CELERY, "ms", bare)
    finally:
        lab.stop(stack.processes)
    for contender, rounds in ((IN_PROCESS, baseline), *queued.items()):
        for latencies in rounds:
            results.sample(SECTION, "1-token p50", contender, "ms", percentile(latencies, 50))
            results.sample(SECTION, "1-token p95", contender, "ms", percentile(latencies, 95))
    for contender, rounds in queued.items():
        for alone, through_queue in zip(baseline, rounds, strict=True):
            difference = percentile(through_queue, 50) - percentile(alone, 50)
            results.sample(SECTION, "queue overhead p50", contender, "ms", difference)


def in_process(config: Config) -> list[list[float]]:
    """The baseline: each repeat's latencies (ms) of 1-token generations in process."""
    log.info("overhead: %s, 1-token jobs", IN_PROCESS)
    argv = [sys.executable, "-m", "bench.inprocess", str(config.tiny_model)]
    argv += [str(config.overhead_jobs), str(config.repeats)]
    run = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=600)
    rounds: list[list[float]] = json.loads(run.stdout)
    return rounds


def set_targets(results: Results) -> None:
    """Issue 32: the 1-token job's queue overhead p50 <= 1.5x a bare Celery round trip's."""
    bare = results.find(SECTION, "bare Celery round trip p50", CELERY)
    if bare is None or not bare.samples:
        return
    for contender, way in ((EXO, ""), (EXO_OPENAI, ", OpenAI's streamed completion")):
        measured = results.find(SECTION, "queue overhead p50", contender)
        if measured is not None and measured.samples:
            name = f"queue overhead p50{way} <= 1.5x a bare Celery round trip"
            results.targets.append(Target(name, measured, bare, "<=", 1.5))
