"""The queue's overhead on the `tiny` model: a 1-token job through the HTTP API (submit, then
stream until done) against `mlx_lm.stream_generate` in process for the same prompts."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from bench.clients import ExoClient
from bench.config import Config
from bench.contenders import Lab, start_exo
from bench.load import sequential
from bench.results import EXO, IN_PROCESS, Results, percentile

log = logging.getLogger("bench")
SECTION = "overhead"


def run(lab: Lab, config: Config, results: Results) -> None:
    log.info("overhead: %s, 1-token jobs", IN_PROCESS)
    argv = [sys.executable, "-m", "bench.inprocess", str(config.tiny_model)]
    argv += [str(config.overhead_jobs), str(config.repeats)]
    baseline: list[list[float]] = json.loads(
        subprocess.run(argv, check=True, capture_output=True, text=True, timeout=600).stdout
    )
    log.info("overhead: %s, 1-token jobs", EXO)
    stack = start_exo(lab, "exo-overhead", config.tiny_model)
    try:
        client = ExoClient(stack.url, ignore_eos=True)
        sequential(client, 3, 1, "warmup")  # connections, first-use paths
        queued: list[list[float]] = []
        for repeat in range(config.repeats):
            traces = sequential(client, config.overhead_jobs, 1, f"overhead {repeat}")
            queued.append([t.latency_s * 1000 for t in traces if t.latency_s is not None])
    finally:
        lab.stop(stack.processes)
    for contender, rounds in ((IN_PROCESS, baseline), (EXO, queued)):
        for latencies in rounds:
            results.sample(SECTION, "1-token p50", contender, "ms", percentile(latencies, 50))
            results.sample(SECTION, "1-token p95", contender, "ms", percentile(latencies, 95))
    for alone, through_queue in zip(baseline, queued, strict=True):
        difference = percentile(through_queue, 50) - percentile(alone, 50)
        results.sample(SECTION, "queue overhead p50", EXO, "ms", difference)
