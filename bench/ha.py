"""What durability costs (issue 30): the queue overhead and drain rows of a stack whose Redis is
the HA stack's (a master, its replica, three Sentinels; every 202 waits for the replica to hold
its job) beside the same stack on a single Redis, in one run, on the `tiny` model.

The two stacks run by turns, never at once: single, HA, single, HA... (one repeat each turn),
so that whatever else loads the machine meanwhile falls on both alike. The issue's target:
the HA stack drains at least 0.8x as many jobs per second as the single Redis."""

from __future__ import annotations

import logging

from bench.clients import ExoClient
from bench.config import Config
from bench.contenders import Lab, start_exo
from bench.load import sequential
from bench.overhead import in_process
from bench.results import Results, Target, percentile
from bench.scale import drain

log = logging.getLogger("bench")
SECTION = "ha"
SINGLE = "exo_tasks, single Redis"
HA = "exo_tasks, HA Redis"
SENDERS = 8


def run(lab: Lab, config: Config, results: Results) -> None:
    baseline = [percentile(latencies, 50) for latencies in in_process(config)]
    for repeat, in_process_p50 in enumerate(baseline):
        for contender in (SINGLE, HA):
            log.info("ha: %s, repeat %d", contender, repeat)
            _measure(lab, config, results, contender, in_process_p50)


def _measure(
    lab: Lab, config: Config, results: Results, contender: str, in_process_p50: float
) -> None:
    jobs = config.ha_drain_jobs
    stack = start_exo(
        lab,
        "exo-ha" if contender == HA else "exo-single",
        config.tiny_model,
        redis_ha=contender == HA,
        # Every job comes from the bench, one client: its quota raised with the queue's.
        max_queued_jobs=jobs * 2,
        max_queued_jobs_per_client=jobs * 2,
    )
    try:
        client = ExoClient(stack.url, ignore_eos=True)
        sequential(client, 3, 1, "warmup")  # connections, first-use paths
        traces = sequential(client, config.overhead_jobs, 1, f"{contender} overhead")
        drained = drain(stack, jobs, SENDERS)
    finally:
        lab.stop(stack.processes)
    latencies = [t.latency_s * 1000 for t in traces if t.latency_s is not None]
    p50 = percentile(latencies, 50)
    results.sample(SECTION, "1-token p50", contender, "ms", p50)
    results.sample(SECTION, "queue overhead p50", contender, "ms", p50 - in_process_p50)
    results.sample(SECTION, "drain rate", contender, "jobs/s", drained.jobs_per_s)
    results.sample(SECTION, "enqueue rate", contender, "jobs/s", drained.sent / drained.enqueue_s)
    row = results.find(SECTION, "drain rate", contender)
    if row is not None:
        row.note = drained.note


def set_targets(results: Results) -> None:
    """Issue 30: the HA stack drains >= 0.8x the single Redis's jobs/s."""
    measured = results.find(SECTION, "drain rate", HA)
    single = results.find(SECTION, "drain rate", SINGLE)
    if measured is not None and single is not None and measured.samples and single.samples:
        results.targets.append(
            Target("HA Redis drain >= 0.8x a single Redis", measured, single, ">=", 0.8)
        )
