"""Metric persistence: the increments observed anywhere, added to one Redis hash per metric
(what is measured, and each hash's fields: exo_tasks.metrics)."""

from __future__ import annotations

from typing import Any

from exo_tasks import metrics
from exo_tasks.store.client import RedisPart


class MetricRecords(RedisPart):
    def write(self, observations: metrics.Observations) -> None:
        pipe = self.redis.pipeline(transaction=False)
        observations.write(pipe)
        pipe.execute()
        observations.clear()

    def read(self) -> dict[str, dict[str, str]]:
        """Every stored metric's hash, by metric name."""
        pipe = self.redis.pipeline(transaction=False)
        for metric in metrics.STORED:
            pipe.hgetall(metric.key)
        return {m.name: stored for m, stored in zip(metrics.STORED, pipe.execute(), strict=True)}

    def memory(self) -> tuple[int, int]:
        """Redis's memory in use and its `maxmemory` (0: no limit), in bytes."""
        return memory_of(self.redis.info("memory"))


def memory_of(info: dict[str, Any]) -> tuple[int, int]:
    """Redis's memory in use and its `maxmemory` (0: no limit), from its `INFO memory`."""
    return int(info["used_memory"]), int(info.get("maxmemory", 0))
