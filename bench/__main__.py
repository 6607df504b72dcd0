"""`make bench`: exo_tasks against mlx_lm.server and mlx-lm in process, in one run on one machine.

Prints a table, writes bench/results/latest.json and bench/results/latest.png. Every process it
starts is stopped by PID at the end, also after a failure, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import signal
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

from bench import (
    batch,
    flood,
    frontdoor,
    ha,
    instances,
    memory,
    overhead,
    prefix,
    report,
    scale,
    stallfree,
    stopping,
    throughput,
)
from bench.config import Config
from bench.contenders import Lab
from bench.results import Results
from exo_tasks.modelgen import ensure_model

log = logging.getLogger("bench")
SECTIONS: dict[str, Callable[[Lab, Config, Results], None]] = {
    "throughput": throughput.run,  # also TTFT and warm vs cold
    "overhead": overhead.run,
    "memory": memory.run,
    "stopping": stopping.run,
    "scale": scale.run,
    "batch": batch.run,
    "frontdoor": frontdoor.run,
    "prefix": prefix.run,
    "instances": instances.run,
    "flood": flood.run,
    "stallfree": stallfree.run,
    "ha": ha.run,
}
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def other_pytests() -> int:
    """pytest processes running on this machine: other test suites compete for the CPU."""
    count = 0
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        count += any("pytest" in part for part in cmdline)
    return count


def _interrupt(signum: int, _: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short windows: to try the bench")
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma-separated from {','.join(SECTIONS)}"
    )
    parser.add_argument("--workdir", type=Path, default=Path("var/bench"))
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench: %(message)s")
    signal.signal(signal.SIGTERM, _interrupt)
    workdir = args.workdir.resolve()
    models = workdir / "models"
    config = Config(
        workdir=workdir,
        bench_model=ensure_model("bench", models / "bench").resolve(),
        tiny_model=ensure_model("tiny", models / "tiny").resolve(),
    )
    if args.quick:
        config = config.quick()
    run: dict[str, Any] = {
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "quick": args.quick,
        "other_pytest_processes_at_start": other_pytests(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "failed_sections": [],
    }
    results = Results()
    lab = Lab(workdir / "runs" / datetime.now().strftime("%Y%m%d-%H%M%S"))
    started = time.monotonic()
    try:
        for name in args.only.split(","):
            try:
                SECTIONS[name](lab, config, results)
            except Exception:  # one broken section must not cost the others' numbers
                log.exception("section %s failed", name)
                run["failed_sections"].append(name)
    finally:
        lab.close()
    run["duration_s"] = round(time.monotonic() - started)
    run["other_pytest_processes_at_end"] = other_pytests()
    report.set_targets(results)
    overhead.set_targets(results)
    memory.set_targets(results)
    stallfree.set_targets(results)
    prefix.set_targets(results)
    instances.set_targets(results)
    ha.set_targets(results)
    report.write_json(results, args.out / "latest.json", run)
    report.chart(results, args.out / "latest.png")
    print(report.table(results))
    print(f"\n{run['duration_s']} s; wrote {args.out / 'latest.json'} and latest.png")
    return 1 if run["failed_sections"] else 0


if __name__ == "__main__":
    sys.exit(main())
