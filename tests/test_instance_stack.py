"""`exo-tasks up` and `down` with an instance on the local host: the stack's worker holds rank 0
of an instance placed from EXO_INSTANCES, another worker (host b, outside the stack) rank 1.
`down` stops the stack in its order: the worker first, whose instance shuts down (rank 0 puts
its job back on the instance's queue, closes the ring, which releases rank 1), then api and
flower, Redis last. No rank process and no ring port survive, within the stack's own bound.
Real processes, real signals, default settings."""

from __future__ import annotations

import re
import time
from datetime import datetime
from pathlib import Path

import requests

from config.settings import Settings
from exo_tasks.instances import FAILED, READY, SHUTTING_DOWN
from exo_tasks.launcher import stop_stages
from exo_tasks.naming import instance_queue, instance_runner_id
from exo_tasks.store import Store
from tests.support.instances import listening, pids_and_ports
from tests.support.launcher import LocalStack, launcher_env
from tests.support.processes import (
    EXO_TASKS,
    Processes,
    embedded_redis_url,
    has_exited,
    start_redis,
    wait_until,
)
from tests.support.workers import start_worker

HOSTS = ("stack-a", "stack-b")
# Loading two ranks and forming the ring took 16 s on the loaded 2-core test machine.
START_TIMEOUT_S = 120.0
# The launcher's own bound for the whole stack: each stage's, one after the other.
STACK_STOP_S = sum(stage.bound_s for stage in stop_stages(Settings(_env_file=None)))
# From rank 0's "runner stopped cleanly" to its worker's "rank exited" (which follows a few Redis
# writes): 0.03-0.08 s measured alone, 0.35 s once in `make test` beside the other lanes. It was
# 0.6-1.8 s while the runner's interpreter tore down MLX, mlx-lm and transformers, and the
# launcher SIGKILLed the worker past its stage.
RANK_EXIT_S = 0.5


def logged_at(log: str, pattern: str) -> float:
    """When the first line of `log` that matches `pattern` was written (its logfmt `ts`)."""
    found = re.search(rf"ts=(\S+) [^\n]*{pattern}", log)
    assert found is not None, f"no line matches {pattern}"
    return datetime.fromisoformat(found.group(1)).timestamp()


def test_down_stops_the_instances_ranks_with_the_stack_in_its_order(
    processes: Processes, tmp_path: Path, tiny_model: Path, gamma_model: Path
) -> None:
    data_dir = tmp_path / "var"
    env = launcher_env(
        data_dir, hostname=HOSTS[0], models=tiny_model, instances=f"{gamma_model}@{','.join(HOSTS)}"
    )
    stack = LocalStack(processes, data_dir, env, tmp_path / "stack.log")
    stack.up()
    redis_url = embedded_redis_url(data_dir / "redis", stack.redis_port)
    (tmp_path / "b").mkdir()
    worker_b = start_worker(processes, redis_url, HOSTS[1], [tiny_model], tmp_path / "b")
    store = stack.store()

    def ready() -> bool:
        assert worker_b.process.poll() is None, worker_b.log_text()[-3000:]
        found = store.instances.all()
        return bool(found) and found[0].status is READY

    wait_until(ready, START_TIMEOUT_S, "the instance Ready", 0.2)
    (instance,) = store.instances.all()
    answer = requests.post(
        f"{stack.api}/v1/jobs",
        json={"model": instance.model, "prompt": "long", "max_tokens": 4000, "ignore_eos": True},
        timeout=10,
    )
    job_id = answer.json()["id"]
    wait_until(lambda: store.streams.streamed_text(job_id)[1] >= 3, 30, "the job's first tokens")
    pids, ports = pids_and_ports(store.instances.get(instance.id) or instance)
    tree = stack.tree()
    assert pids[0] in {p.pid for p in tree}, "rank 0 runs under the stack's worker"

    # The launcher's bound runs from its signal: `down` says so as it sends it. (The command's
    # own start, its imports, comes first: 0.7 s on an idle machine, 1.2-3.3 s here beside the
    # decoding instance.)
    down_log = tmp_path / "down.log"
    launched = time.monotonic()
    down = processes.start([EXO_TASKS, "down"], env, down_log)
    wait_until(lambda: "stopping the stack" in down_log.read_text(), 60, "`down`'s signal", 0.01)
    started = time.monotonic()
    assert down.wait(timeout=60) == 0, down_log.read_text()
    every = [p.pid for p in tree] + pids  # rank 1 (host b's) included
    # Waited for past the bound, so that a slow stop still shows everything else it did.
    wait_until(lambda: all(has_exited(p) for p in every), 4 * STACK_STOP_S, "every process gone")
    took = time.monotonic() - started
    print(
        f"`exo-tasks down` with an instance: every process and rank gone {took:.2f}s after its "
        f"signal ({started - launched:.2f}s to start the command)"
    )
    assert not any(listening(p) for p in ports), "a ring port is still held"
    assert worker_b.process.poll() is None, "host b's worker is no part of the stack"

    # What the stack left in its Redis (its AOF), read with a redis-server of our own: the
    # instance shutting down, naming the host that left, and the job back on the instance's
    # queue. The move's end (every rank Shutdown, then Failed) is host b's to write once its
    # rank has exited, which may come after the stack's Redis stopped (host b is no part of
    # the stack, which does not wait for it): then host b writes it once Redis is back.
    redis = start_redis(processes, data_dir / "redis", port=stack.redis_port)
    after = Store.from_url(redis.url)
    job = after.jobs.get(job_id)
    assert job is not None and job.status == "queued" and job.attempts == 1, job
    assert after.jobs.queue_depth(instance_queue(instance.id)) == 1
    left = after.instances.get(instance.id)
    assert left is not None and left.status in (SHUTTING_DOWN, FAILED), left
    print(f"the instance {left.status} as the stack's Redis stopped")
    record = wait_until(
        lambda: (found := after.instances.get(instance.id)) and found.status is FAILED and found,
        10,
        "the instance Failed",
    )
    assert record.error == f"rank 0 on host {HOSTS[0]}: its worker stopped", record.error

    # Within the stack's own bound, each stage in time (no SIGKILL from the launcher), and
    # every rank exited on its own (exit 0: Shutdown).
    log = stack.log_text()
    assert "did not stop in time" not in log, log[-3000:]
    assert took < STACK_STOP_S, f"every process gone only {took:.1f}s after `down`'s signal"
    rank0 = re.escape(instance_runner_id(instance.id, 0))
    stopped = logged_at(log, f'msg="runner stopped cleanly" runner={rank0} ')
    exited = logged_at(log, f'msg="rank exited" .*runner={rank0} ')
    assert exited - stopped < RANK_EXIT_S, f"rank 0 exited {exited - stopped:.2f}s after its stop"
    assert [r.status for r in record.ranks] == ["Shutdown", "Shutdown"], record.ranks
