"""Memory beside the model: PSS (proportional set size, `/proc/<pid>/smaps_rollup`) of every
process of a default stack (`exo-tasks up`), by role, idle after one job and again after many.

`python -m bench.memory [--jobs 300]` starts the stack in a data dir of its own (the `chat`
model copied in from `--model-from` when given, else made by the worker), on free ports, and
stops it at the end. Linux only (smaps_rollup).
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

IDLE_S = 3.0
READY_S = 180.0
JOB = {"prompt": "hello", "max_tokens": 8}
# The roles that make a worker host; the runner is left out (its model and MLX).
HOST_ROLES = ("pool children", "batch feeder", "worker main", "resource tracker")


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


def start_stack(data_dir: Path, model_from: Path | None) -> tuple[subprocess.Popen[bytes], str]:
    if model_from is not None:
        shutil.copytree(model_from, data_dir / "models" / "chat")
    ports = {name: _free_port() for name in ("EXO_REDIS_PORT", "EXO_API_PORT", "EXO_FLOWER_PORT")}
    env = {**os.environ, "EXO_DATA_DIR": str(data_dir), **{k: str(v) for k, v in ports.items()}}
    exo = Path(sys.executable).parent / "exo-tasks"
    launcher = subprocess.Popen(
        [str(exo), "up"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return launcher, f"http://127.0.0.1:{ports['EXO_API_PORT']}"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__)
    parser.add_argument("--jobs", type=int, default=300, help="jobs before the second reading")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--model-from", type=Path, default=None, help="a made `chat` model")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="exo-memory-") as tmp:
        launcher, api = start_stack(Path(tmp), args.model_from)
        try:
            wait_ready(api, launcher)
            print("first job:", run_job(api))
            time.sleep(IDLE_S)
            report("idle after one job", measure(launcher.pid))
            if args.jobs:
                print(f"\n{args.jobs} jobs:", run_jobs(api, args.jobs, args.clients))
                time.sleep(IDLE_S)
                report(f"idle after {args.jobs + 1} jobs", measure(launcher.pid))
        finally:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(30)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()


if __name__ == "__main__":
    main()
