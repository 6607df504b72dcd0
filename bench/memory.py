"""Memory beside the model: PSS (proportional set size, `/proc/<pid>/smaps_rollup`) of every
process of a default stack (`exo-tasks up`), by role, idle after one job, again after many, and
once the pool has shrunk back after them.

`make bench` runs it as its section `memory` (the targets of issue 32: a worker host <= 300 MiB
and the whole stack <= 600 MiB, the runner left out, idle). `python -m bench.memory [--jobs 300]`
runs it alone and prints each process's figures. Either starts the stack in a data dir of its
own (the `chat` model copied in from `--model-from` when given, else made by the worker), on
free ports, and stops it at the end. Linux only (smaps_rollup).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import requests

from bench.config import Config
from bench.contenders import Lab
from bench.results import EXO, Results, Target

IDLE_S = 3.0
# Celery's autoscaler stops idle pool children once no task came for 30 s; it looks every 30 s.
SHRUNK_S = 65.0
READY_S = 180.0
JOB = {"prompt": "hello", "max_tokens": 8}
# The roles that make a worker host; the runner is left out (its model and MLX).
HOST_ROLES = ("pool children", "batch feeder", "worker main", "resource tracker")
SECTION = "memory"
CLIENTS = 16
# Issue 32's bounds, on a host and a stack at rest (the readings with "idle" in their names).
HOST_MIB = 300.0
STACK_MIB = 600.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def smaps(pid: int) -> dict[str, float]:
    """The rollup's fields, in MiB."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) / 1024
    return fields


def _maps_mlx(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return "mlx" in maps.read()


def role(process: psutil.Process, launcher: int, worker_cmdline: list[str]) -> str:
    """What one process of the stack is."""
    cmdline = process.cmdline()
    joined = " ".join(cmdline)
    if process.pid == launcher:
        return "launcher"
    if process.name() == "redis-server":
        return "redis-server"
    if "gunicorn" in joined:
        return "api master" if process.ppid() == launcher else "api workers"
    if "flower" in cmdline:
        return "flower"
    if "exo-tasks" in joined and cmdline[-1] == "redis":
        return "redis wrapper"
    if cmdline == worker_cmdline:
        if process.ppid() == launcher:
            return "worker main"
        name = Path(f"/proc/{process.pid}/comm").read_text().strip()
        return "batch feeder" if name == "exo-feeder" else "pool children"
    if "resource_tracker" in joined:
        return "resource tracker"
    if "spawn_main" in joined:
        return "runner" if _maps_mlx(process.pid) else "batch feeder"
    return f"other: {joined[:60]}"


# Of one process, in MiB: its PSS, what only it maps (private), and its PSS in anonymous
# memory (the heap: what a fork shares until one side writes to it), the rest being files.
Figures = tuple[float, float, float]


def measure(launcher: int) -> dict[str, list[Figures]]:
    """Per role: the figures of each process."""
    root = psutil.Process(launcher)
    everyone = [root, *root.children(recursive=True)]
    worker = next(p for p in everyone if "worker" in p.cmdline() and p.ppid() == launcher)
    roles: dict[str, list[Figures]] = defaultdict(list)
    for process in everyone:
        try:
            figures = smaps(process.pid)
            name = role(process, launcher, worker.cmdline())
        except (psutil.Error, OSError):
            continue  # gone meanwhile
        private = figures["Private_Clean"] + figures["Private_Dirty"]
        roles[name].append((figures["Pss"], private, figures["Pss_Anon"]))
    return roles


def report(title: str, roles: dict[str, list[Figures]]) -> dict[str, float]:
    print(f"\n{title}")
    totals = {}
    for name, figures in sorted(roles.items(), key=lambda kv: -sum(f[0] for f in kv[1])):
        pss = sum(f[0] for f in figures)
        totals[name] = pss
        anon = sum(f[2] for f in figures)
        each = sorted(f[0] for f in figures)
        private = sorted(f[1] for f in figures)
        spread = (
            f"  {len(figures)} x {each[0]:.1f}-{each[-1]:.1f} (private median "
            f"{private[len(private) // 2]:.1f}"
            if len(figures) > 1
            else f"  (private {private[0]:.1f}"
        )
        print(f"  {name:<18} {pss:7.1f} MiB{spread}, anonymous {anon:.1f})")
    host = sum(totals.get(name, 0.0) for name in HOST_ROLES)
    stack = sum(v for k, v in totals.items() if k != "runner")
    print(f"  {'worker host':<18} {host:7.1f} MiB  (runner excluded)")
    print(f"  {'whole stack':<18} {stack:7.1f} MiB  (runner excluded)")
    return {"host": host, "stack": stack, **totals}


def run_job(api: str) -> str:
    reply = requests.post(f"{api}/v1/jobs", json=JOB, timeout=30)
    reply.raise_for_status()
    job_id = reply.json()["id"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = requests.get(f"{api}/v1/jobs/{job_id}", timeout=30).json()["status"]
        if status not in ("queued", "running"):
            return str(status)
        time.sleep(0.05)
    return "unfinished"


def run_jobs(api: str, count: int, clients: int) -> dict[str, int]:
    with ThreadPoolExecutor(clients) as pool:
        statuses = list(pool.map(lambda _: run_job(api), range(count)))
    return {s: statuses.count(s) for s in set(statuses)}


def wait_ready(api: str, launcher: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if launcher.poll() is not None:
            raise SystemExit(f"the stack exited: {launcher.returncode}")
        try:
            if requests.get(f"{api}/readyz", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise SystemExit("the stack was not ready in time")


def stack_argv_env(
    data_dir: Path, model_from: Path | None
) -> tuple[list[str], dict[str, str], str]:
    """`exo-tasks up` in `data_dir` on free ports: its command, environment and API's URL."""
    if model_from is not None:
        shutil.copytree(model_from, data_dir / "models" / "chat")
    ports = {name: _free_port() for name in ("EXO_REDIS_PORT", "EXO_API_PORT", "EXO_FLOWER_PORT")}
    env = {**os.environ, "EXO_DATA_DIR": str(data_dir), **{k: str(v) for k, v in ports.items()}}
    exo = Path(sys.executable).parent / "exo-tasks"
    return [str(exo), "up"], env, f"http://127.0.0.1:{ports['EXO_API_PORT']}"


def readings(
    launcher: subprocess.Popen[bytes], api: str, jobs: int, clients: int
) -> dict[str, dict[str, float]]:
    """The stack's figures by role, idle after one job, right after `jobs` more, and once the
    pool has shrunk back (Celery's autoscaler keeps a burst's children 30-60 s)."""
    wait_ready(api, launcher)
    print("first job:", run_job(api))
    time.sleep(IDLE_S)
    taken = {"idle after one job": report("idle after one job", measure(launcher.pid))}
    if jobs:
        print(f"\n{jobs} jobs:", run_jobs(api, jobs, clients))
        time.sleep(IDLE_S)
        title = f"right after {jobs} more jobs"
        taken[title] = report(title, measure(launcher.pid))
        time.sleep(SHRUNK_S - IDLE_S)
        title = f"idle {SHRUNK_S:.0f} s after them"
        taken[title] = report(title, measure(launcher.pid))
    return taken


def run(lab: Lab, config: Config, results: Results) -> None:
    """The section: one default stack, the `tiny` model as its `chat` (the runner is left out)."""
    processes, directory = lab.group("exo-memory")
    argv, env, api = stack_argv_env(directory / "data", config.tiny_model)
    launcher = processes.start(argv, env, directory / "stack.log")
    try:
        taken = readings(launcher, api, config.memory_jobs, CLIENTS)
    finally:
        lab.stop(processes)
    for when, totals in taken.items():
        results.sample(SECTION, f"worker host, {when}", EXO, "MiB", totals["host"])
        results.sample(SECTION, f"whole stack, {when}", EXO, "MiB", totals["stack"])


def set_targets(results: Results) -> None:
    """Issue 32: at rest, a worker host <= 300 MiB and the whole stack <= 600 MiB, the runner
    (its model and caches) left out."""
    for row in results.measurements:
        if row.section != SECTION or "idle" not in row.name:
            continue
        bound = HOST_MIB if row.name.startswith("worker host") else STACK_MIB
        results.targets.append(
            Target(f"{row.name} <= {bound:.0f} MiB", row, None, "<=", bound, "MiB")
        )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__)
    parser.add_argument("--jobs", type=int, default=Config.memory_jobs, help="the burst's jobs")
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--model-from", type=Path, default=None, help="a made `chat` model")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="exo-memory-") as tmp:
        argv, env, api = stack_argv_env(Path(tmp), args.model_from)
        launcher = subprocess.Popen(
            argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            readings(launcher, api, args.jobs, args.clients)
        finally:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(30)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()


if __name__ == "__main__":
    main()
