"""What a bench run produces: measurements (raw samples, median, min, max) and targets."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Literal

EXO = "exo_tasks"
EXO_OPENAI = "exo_tasks, OpenAI's streamed completion"
MLX_SERVER = "mlx_lm.server"
UNBATCHED = "exo_tasks, one job at a time"
EXO_NO_CACHE = "exo_tasks, prompt cache off"
EXO_TWO_WORKERS = "exo_tasks, 2 workers"
EXO_TWO_WORKERS_UNROUTED = "exo_tasks, 2 workers, prefix routing off"
IN_PROCESS = "stream_generate in process"
CELERY = "Celery, a no-op task"
Op = Literal[">=", "<="]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), interpolated between the closest ranks."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class Measurement:
    """One row: a quantity for one contender, measured `len(samples)` times."""

    section: str
    name: str
    contender: str
    unit: str
    samples: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def key(self) -> str:
        return f"{self.section}/{self.name}/{self.contender}"

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")

    @property
    def min(self) -> float:
        return min(self.samples) if self.samples else float("nan")

    @property
    def max(self) -> float:
        return max(self.samples) if self.samples else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {
            "section": self.section,
            "name": self.name,
            "contender": self.contender,
            "unit": self.unit,
            "samples": [round(s, 4) for s in self.samples],
            "median": _finite(self.median),
            "min": _finite(self.min),
            "max": _finite(self.max),
            "note": self.note,
        }


@dataclass
class Target:
    """A goal on the medians of one run: `measured / reference` (or `measured` alone when there
    is no reference) compared with `bound`."""

    name: str
    measured: Measurement
    reference: Measurement | None
    op: Op
    bound: float
    unit: str = "x"

    @property
    def value(self) -> float:
        if self.reference is None:
            return self.measured.median
        return self.measured.median / self.reference.median

    @property
    def passed(self) -> bool:
        value = self.value
        return value >= self.bound if self.op == ">=" else value <= self.bound

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "measured": self.measured.key,
            "reference": self.reference.key if self.reference else None,
            "value": _finite(self.value),
            "op": self.op,
            "bound": self.bound,
            "unit": self.unit,
            "passed": self.passed,
        }


def _finite(value: float) -> float | None:
    return None if value != value else round(value, 4)  # NaN → null in JSON


@dataclass
class Results:
    """Every measurement of a run, looked up by key, plus the targets set on them."""

    measurements: list[Measurement] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)

    def add(self, measurement: Measurement) -> Measurement:
        self.measurements.append(measurement)
        return measurement

    def sample(self, section: str, name: str, contender: str, unit: str, value: float) -> None:
        """Add one sample to a row, creating the row on its first sample."""
        row = self.find(section, name, contender)
        if row is None:
            row = self.add(Measurement(section, name, contender, unit))
        row.samples.append(value)

    def find(self, section: str, name: str, contender: str) -> Measurement | None:
        key = f"{section}/{name}/{contender}"
        return next((m for m in self.measurements if m.key == key), None)
