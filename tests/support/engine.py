"""The batch engine driven step by step, in process, as the runner's loop drives it: for tests
of what it makes of each job."""

from __future__ import annotations

from typing import Any

from mlx_lm import stream_generate

from exo_tasks.runner.engine import BatchEngine
from exo_tasks.runner.lane import TokenDelta
from exo_tasks.types import SamplingParams


def alone(loaded: tuple[Any, Any], prompt: str, max_tokens: int) -> tuple[str, int]:
    """Text and token count (EOS included) of mlx-lm's own single-request generation."""
    model, tokenizer = loaded
    responses = list(stream_generate(model, tokenizer, tokenizer.encode(prompt), max_tokens))
    return "".join(r.text for r in responses), responses[-1].generation_tokens


class Run:
    """Drives an engine and collects every job's deltas."""

    def __init__(self, engine: BatchEngine) -> None:
        self.engine = engine
        self.deltas: dict[str, list[TokenDelta]] = {}
        self.steps = 0
        self.first_step: dict[str, int] = {}  # job id -> the step that gave its first token

    def add(self, job_id: str, prompt: str, **params: Any) -> None:
        tokens = self.engine.encode(prompt, None)
        self.engine.add(job_id, tokens, SamplingParams.model_validate(params))
        self.deltas[job_id] = []

    def step(self) -> list[TokenDelta]:
        deltas = self.engine.step()
        self.steps += 1
        for d in deltas:
            if not self.deltas[d.job_id]:
                self.first_step[d.job_id] = self.steps
            assert not self.deltas[d.job_id] or self.deltas[d.job_id][-1].finish_reason is None
            self.deltas[d.job_id].append(d)
        return deltas

    def until_done(self) -> None:
        while self.engine.active_jobs:
            self.step()

    def text(self, job_id: str) -> str:
        return "".join(d.text for d in self.deltas[job_id])

    def last(self, job_id: str) -> TokenDelta:
        return self.deltas[job_id][-1]
