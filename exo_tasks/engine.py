"""Continuous batching for the runner: many jobs decode together in one mlx-lm BatchGenerator.

The runner process owns the model and drives `BatchEngine.step()` in its loop; jobs are added
and removed between steps, while others are mid-generation. Not thread-safe: one caller only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.sample_utils import apply_top_p, make_sampler

from exo_tasks.types import ChatMessage, SamplingParams

Sampler = Callable[[mx.array], mx.array]
EngineFinish = Literal["stop", "length"]


@dataclass(frozen=True)
class TokenDelta:
    """What one step produced for one job."""

    job_id: str
    text: str  # new text to publish (may be "" while a possible stop string is held back)
    completion_tokens: int  # tokens sampled so far, the EOS included (it counts to max_tokens)
    finish_reason: EngineFinish | None  # set on the job's last delta


@dataclass
class _Job:
    job_id: str
    detokenizer: Any
    stop: list[str]
    text: str = ""  # decoded so far, cut before a stop string once one is found
    published: int = 0  # length of the prefix of `text` already handed out
    tokens: int = 0

    def feed(self, segment: str, final: bool) -> tuple[str, bool]:
        """Take newly decoded text; return the text safe to publish and whether a stop hit."""
        self.text += segment
        # Published text never ends in the start of a stop string, so a match starts after it.
        hits = [i for s in self.stop if (i := self.text.find(s, self.published)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            end = len(self.text)
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) - self._held_back()
        out, self.published = self.text[self.published : end], end
        return out, bool(hits)

    def _held_back(self) -> int:
        """Length of the longest unpublished tail that could still grow into a stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text) - self.published), longest, -1):
                if self.text.endswith(s[:k]):
                    longest = k
                    break
        return longest


def _seeded_sampler(temperature: float, top_p: float, seed: int) -> Sampler:
    """A sampler with its own PRNG stream, so a seed gives the same text alone or in a batch.

    BatchGenerator calls a job's sampler once per sampled token, on that job's row only (a
    batch with more than one sampler is sampled row by row), so the key sequence is the job's.
    """
    key = mx.random.key(seed)

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, step_key = mx.random.split(key)
        if 0.0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * (1.0 / temperature), key=step_key)

    return sample


class BatchEngine:
    """Jobs in, token deltas out: a thin, job-id-keyed layer over mlx-lm's BatchGenerator."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,  # mlx_lm TokenizerWrapper
        *,
        completion_batch_size: int = 32,
        prefill_batch_size: int = 8,
    ) -> None:
        self._tokenizer = tokenizer
        self._eos_ids = frozenset[int](tokenizer.eos_token_ids)
        # Stop-sequence automata are immutable (each request gets its own matcher): share them.
        self._stop_on_eos = StopSequences([[eos] for eos in sorted(self._eos_ids)])
        self._never_stop = StopSequences()
        # Any: mlx-lm's methods are untyped, and it takes None in its samplers list (greedy).
        self._generator: Any = BatchGenerator(
            model,
            completion_batch_size=completion_batch_size,
            prefill_batch_size=prefill_batch_size,
        )
        self._jobs: dict[int, _Job] = {}  # by generator uid
        self._uids: dict[str, int] = {}
        self._samplers: dict[tuple[float, float], Sampler] = {}
        self._largest_batch = 0

    @property
    def active_jobs(self) -> int:
        return len(self._jobs)

    @property
    def largest_batch(self) -> int:
        """The most jobs ever decoding together in one generation step."""
        return self._largest_batch

    def encode(self, prompt: str | None, messages: list[ChatMessage] | None) -> list[int]:
        """Prompt tokens for a raw prompt, or for chat messages through the chat template."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if prompt is not None:
            return list(self._tokenizer.encode(prompt))
        chat = [m.model_dump() for m in messages or []]
        return list(self._tokenizer.apply_chat_template(chat, add_generation_prompt=True))

    def add(self, job_id: str, prompt_tokens: list[int], params: SamplingParams) -> None:
        """Queue a job; it joins the running batch on a later step."""
        # Checked here because one bad entry makes BatchGenerator.insert raise for all of it.
        if not prompt_tokens:
            raise ValueError(f"job {job_id}: empty prompt")
        if params.max_tokens <= 0:
            raise ValueError(f"job {job_id}: max_tokens must be > 0")
        if job_id in self._uids:
            raise ValueError(f"job {job_id} is already in the engine")
        (uid,) = self._generator.insert(
            [prompt_tokens],
            max_tokens=[params.max_tokens],
            samplers=[self._sampler(params)],
            stop_sequences=[self._never_stop if params.ignore_eos else self._stop_on_eos],
        )
        self._uids[job_id] = uid
        self._jobs[uid] = _Job(job_id, self._tokenizer.detokenizer, list(params.stop))

    def remove(self, job_id: str) -> None:
        """Cancel a job in any phase; unknown or finished jobs are ignored (cancel races)."""
        uid = self._uids.pop(job_id, None)
        if uid is not None:
            del self._jobs[uid]
            self._generator.remove([uid])

    def step(self) -> list[TokenDelta]:
        """Run one prefill/decode step; one delta per job that sampled a token."""
        if not self._jobs:
            return []
        _, responses = self._generator.next()
        self._largest_batch = max(self._largest_batch, len(responses))
        deltas = []
        for r in responses:
            job = self._jobs[r.uid]
            job.tokens += 1
            if r.token not in self._eos_ids:  # EOS is never text, even with ignore_eos
                job.detokenizer.add_token(r.token)
            if r.finish_reason is not None:
                job.detokenizer.finalize()
            text, hit_stop = job.feed(job.detokenizer.last_segment, r.finish_reason is not None)
            finish: EngineFinish | None = "stop" if hit_stop else r.finish_reason
            if finish is not None:
                # The generator already dropped a job it finished itself; a stop string is ours.
                self.remove(job.job_id)
            deltas.append(TokenDelta(job.job_id, text, job.tokens, finish))
        return deltas

    def warmup(self) -> None:
        """Run one short generation so the first real job does not pay for lazy setup.

        Call it before adding jobs: it steps until the engine is empty and drops the deltas.
        """
        params = SamplingParams.model_validate({"max_tokens": 4, "ignore_eos": True})
        self.add("__warmup__", self.encode("warmup", None), params)
        while self._jobs:
            self.step()

    def close(self) -> None:
        """Drop every job and give back what the generator holds (the wired-memory limit)."""
        self._generator.remove(list(self._jobs))
        self._jobs.clear()
        self._uids.clear()
        self._generator.close()

    def _sampler(self, params: SamplingParams) -> Sampler | None:
        if params.temperature == 0.0:
            return None  # BatchGenerator's own greedy sampler
        if params.seed is not None:
            return _seeded_sampler(params.temperature, params.top_p, params.seed)
        # BatchGenerator samples the batch in one call only when every row has the same sampler
        # object (else row by row), so jobs with equal settings share one.
        setting = (params.temperature, params.top_p)
        if setting not in self._samplers:
            self._samplers[setting] = make_sampler(params.temperature, top_p=params.top_p)
        return self._samplers[setting]
