"""How much a bench run measures; `--quick` is for trying the bench itself, not for numbers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Config:
    workdir: Path
    bench_model: Path
    tiny_model: Path
    repeats: int = 3
    window_s: float = 12.0  # each throughput repeat is one window of this length
    concurrency: tuple[int, ...] = (1, 8, 32)
    max_tokens: int = 64
    ttft_requests: int = 8  # per repeat, one client, streaming
    ttft_max_tokens: int = 4
    probe_max_tokens: int = 16  # the warm/cold probe jobs
    overhead_jobs: int = 40  # per repeat, 1-token jobs one after another
    stop_jobs_in_flight: int = 4
    scale_jobs: int = 10_000
    scale_repeats: int = 1
    scale_workers: int = 2
    scale_senders: int = 8
    batch_lines: int = 2000
    ha_drain_jobs: int = 1000  # per repeat and Redis, 1-token jobs sent by 8 senders at once
    stall_prompt_tokens: int = 7000  # each long prompt of the stall-free section
    memory_jobs: int = 300  # the burst before the memory section's later readings

    def quick(self) -> Config:
        return Config(
            self.workdir,
            self.bench_model,
            self.tiny_model,
            repeats=2,
            window_s=4.0,
            concurrency=(1, 8),
            ttft_requests=3,
            overhead_jobs=10,
            scale_jobs=300,
            batch_lines=300,
            ha_drain_jobs=200,
            stall_prompt_tokens=600,
            memory_jobs=60,
        )
