"""A worker at its default settings keeps two pool children while idle and forks one for each job
that finds none free, up to EXO_WORKER_CONCURRENCY (Celery's autoscaler): a running job holds its
child, so a burst runs at once, and an idle host holds two children's memory, not 34.
How far it shrinks back after a burst is `python -m bench.memory`'s (Celery waits 30-60 s)."""

from __future__ import annotations

from pathlib import Path

from config.settings import Settings
from exo_tasks.naming import runner_id_for
from tests.support.processes import Processes, wait_until
from tests.support.stack import LONG, Stack, new_worker
from tests.support.workers import pool_children

HOST = "host-pool"
BURST = 12
RUNNING_WITHIN_S = 30.0


def test_an_idle_worker_keeps_two_pool_children_and_a_burst_runs_at_once(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    defaults = Settings()
    worker = new_worker(stack, processes, tiny_model, tmp_path, HOST)
    assert len(pool_children(worker)) == defaults.worker_idle_concurrency == 2
    assert defaults.worker_concurrency > BURST
    jobs = [stack.api.submit(**LONG, host=HOST) for _ in range(BURST)]
    try:
        runner = runner_id_for("tiny", HOST)
        wait_until(
            lambda: (state := stack.store.runners.get(runner)) and state.active_jobs == BURST,
            RUNNING_WITHIN_S,
            f"{BURST} jobs running together on {HOST}",
        )
        # Each job's task holds a pool child while it follows the job: the pool grows to the
        # burst (the jobs may run before their tasks start: exo_tasks.direct).
        wait_until(
            lambda: len(pool_children(worker)) >= BURST,
            RUNNING_WITHIN_S,
            f"the pool grown to {BURST} children",
        )
    finally:
        for job in jobs:
            assert stack.api.post(f"/v1/jobs/{job}/cancel").status_code == 202
    for job in jobs:
        assert stack.api.wait_job(job)["status"] == "cancelled"
