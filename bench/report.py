"""The run's targets, its table, bench/results/latest.json and the chart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.results import (
    EXO,
    EXO_OPENAI,
    IN_PROCESS,
    MLX_SERVER,
    UNBATCHED,
    Measurement,
    Op,
    Results,
    Target,
)

SECTION_TITLES = {
    "throughput": "1. Throughput under concurrency (bench model, 64-token jobs)",
    "ttft": "2. Time to first token, streaming (bench model)",
    "overhead": "3. Queue overhead (tiny model, 1-token jobs)",
    "warm_cold": "4. Warm vs cold (bench model, 16-token job)",
    "stopping": "5. Stopping: request to process gone (tiny model)",
    "queue_scale": "6. Queue scale (tiny model, 1-token jobs, 2 workers)",
    "front_door": "7. Front door: streams held open at once (tiny model, 256-token completions)",
    "prefix_cache": "9. Prompt reuse (bench model, chat, 64 tokens out)",
    "ha": "11. What durability costs: HA Redis beside a single Redis (tiny model, 1-token jobs)",
}


def set_targets(results: Results) -> None:
    """The issue's targets, as ratios (or bounds) on the medians of this run."""

    def ratio(name: str, section: str, row: str, reference: str, op: Op, bound: float) -> None:
        measured, ref = results.find(section, row, EXO), results.find(section, row, reference)
        if measured is not None and ref is not None and measured.samples and ref.samples:
            results.targets.append(Target(name, measured, ref, op, bound))

    for clients in (32, 8):
        row = f"tokens/s, {clients} clients"
        ratio(
            f"throughput at {clients} clients >= 1.0x mlx_lm.server",
            "throughput",
            row,
            MLX_SERVER,
            ">=",
            1.0,
        )
    ratio(
        "throughput at 32 clients >= 2x one job at a time",
        "throughput",
        "tokens/s, 32 clients",
        UNBATCHED,
        ">=",
        2.0,
    )
    for level in ("1 client", "8 clients", "32 clients"):
        ratio(
            f"TTFT p50, {level} <= 1.2x mlx_lm.server",
            "ttft",
            f"TTFT p50, {level}",
            MLX_SERVER,
            "<=",
            1.2,
        )
    overhead = results.find("overhead", "queue overhead p50", EXO)
    if overhead is not None and overhead.samples:
        results.targets.append(
            Target("queue overhead p50 <= 10 ms", overhead, None, "<=", 10, "ms")
        )
    _front_door_targets(results)
    drain = results.find("queue_scale", "drain rate", EXO)
    if drain is not None and drain.samples:
        results.targets.append(
            Target("queue drained >= 100 jobs/s", drain, None, ">=", 100, "jobs/s")
        )


def _front_door_targets(results: Results) -> None:
    """At 2,000 open streams: every first byte within 2 s, /healthz p99 < 100 ms, no error."""
    bounds = [
        ("TTFB p99, 2000 streams", "s", 2.0),
        ("/healthz p99, 2000 streams", "ms", 100.0),
        ("errors, 2000 streams", "", 0.0),
    ]
    for row, unit, bound in bounds:
        measured = results.find("front_door", row, EXO)
        if measured is not None and measured.samples:
            name = f"front door: {row} <= {bound:g} {unit}".rstrip()
            results.targets.append(Target(name, measured, None, "<=", bound, unit))


def _number(value: float) -> str:
    if value != value:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _cell(row: Measurement) -> str:
    return f"{_number(row.median)} ({_number(row.min)}-{_number(row.max)})"


def table(results: Results) -> str:
    """Every row, median (min-max), by section; then the targets with pass/fail."""
    lines = []
    for section, title in SECTION_TITLES.items():
        rows = [m for m in results.measurements if m.section == section]
        if not rows:
            continue
        lines += ["", title]
        for row in rows:
            note = f"  [{row.note}]" if row.note else ""
            lines.append(
                f"  {row.name:<34} {row.contender:<28} {_cell(row):>24} {row.unit}"
                f"  n={len(row.samples)}{note}"
            )
    if results.targets:
        lines += ["", "Targets (medians of this run)"]
        for target in results.targets:
            verdict = "PASS" if target.passed else "FAIL"
            lines.append(f"  {verdict}  {target.name:<52} {_number(target.value)} {target.unit}")
    return "\n".join(lines)


def write_json(results: Results, path: Path, run: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "run": run,
        "measurements": [m.to_json() for m in results.measurements],
        "targets": [t.to_json() for t in results.targets],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


COLORS = {
    EXO: "#1f77b4",
    EXO_OPENAI: "#9467bd",
    MLX_SERVER: "#ff7f0e",
    UNBATCHED: "#7f7f7f",
    IN_PROCESS: "#2ca02c",
}


def _bars(axis: Any, results: Results, section: str, names: list[str], title: str) -> None:
    """Grouped bars, one group per row name, one bar per contender, min-max as error bars."""
    contenders = [c for c in COLORS if any(results.find(section, n, c) for n in names)]
    width = 0.8 / max(len(contenders), 1)
    for index, contender in enumerate(contenders):
        rows = [results.find(section, n, contender) for n in names]
        xs = [i + index * width for i, r in enumerate(rows) if r is not None]
        found = [r for r in rows if r is not None]
        medians = [r.median for r in found]
        errors = [[r.median - r.min for r in found], [r.max - r.median for r in found]]
        axis.bar(
            xs, medians, width, yerr=errors, capsize=3, label=contender, color=COLORS[contender]
        )
    axis.set_xticks([i + width * (len(contenders) - 1) / 2 for i in range(len(names))])
    axis.set_xticklabels([n.split(", ")[-1] if ", " in n else n for n in names], fontsize=8)
    axis.set_title(title, fontsize=10)
    if found := [m for m in results.measurements if m.section == section and m.name in names]:
        axis.set_ylabel(found[0].unit)
    if contenders:  # a section this run left out has no bars, nor a legend
        axis.legend(fontsize=7)


def chart(results: Results, path: Path) -> None:
    """Four panels: throughput, TTFT p50, 1-token latency, stopping times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = ["1 client", "8 clients", "32 clients"]
    stops = sorted({m.name for m in results.measurements if m.section == "stopping"})
    panels = [
        ("throughput", [f"tokens/s, {lv}" for lv in levels], "Throughput, bench model"),
        ("ttft", [f"TTFT p50, {lv}" for lv in levels], "Time to first token p50, bench model"),
        ("overhead", ["1-token p50", "1-token p95"], "1-token job latency, tiny model"),
        ("stopping", stops, "Stop to process gone, tiny model (log scale)"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for axis, (section, names, title) in zip(axes.flat, panels, strict=True):
        _bars(axis, results, section, names, title)
    axes[1][1].set_yscale("log")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
