"""Prefill steps budgeted in time, not tokens, so that decoding jobs never stall behind a long
prompt (the stall-free batching of Sarathi-Serve and vLLM's chunked prefill).

A lane's step decodes one token for each of its decoding jobs, then prefills a chunk of each
prompt in prefill; every decoding job waits for the whole step (and, as lanes step together,
for the slowest lane's). On the CPU a chunk's time grows with its tokens: 256 tokens of the
`bench` model took 4.4 s on 2 cores, and a bystander's stream stalled that long. So while any
job decodes, a step may prefill only for about as long as a decode step takes (at least
MIN_STEP_S): a decoding job's gap between tokens stays within about twice its gap without the
prompts, while the prompts still get the larger part of the time they would get alone.

The cost of a prompt token is measured as the lane runs (it grows with the prompt's length, as
attention reads more of it) and the chunk follows it: budget / cost per token.
"""

from __future__ import annotations

from dataclasses import dataclass

# A step's prefill may take this long even when decode steps are shorter: a gap a reader does
# not notice, and enough for a prompt to progress at a useful rate on a small model.
MIN_STEP_S = 0.1
# Prompt tokens a step prefills at least (and before any has been measured on the lane). A
# prefill pass costs more than its tokens (on the `bench` model, 2 loaded cores, a 1-token
# chunk added 0.3-1 s to a 0.4 s decode step, 16 tokens 0.8 s): a few tokens a step amortise
# it, or a long prompt would take one step per token.
MIN_CHUNK = 8
SMOOTHING = 0.5  # the weight of the latest measurement in the running estimates


def _smoothed(old: float | None, new: float) -> float:
    return new if old is None else SMOOTHING * new + (1 - SMOOTHING) * old


@dataclass
class PrefillPace:
    """A lane's running estimates: the time of a step that only decodes, and the time of one
    prompt token in a step that prefills."""

    decode_s: float | None = None
    token_s: float | None = None

    def observe(self, seconds: float, prompt_tokens: int, decoded: bool) -> None:
        """A step took `seconds`, prefilling `prompt_tokens` and decoding (or not)."""
        if not prompt_tokens:
            if decoded:
                self.decode_s = _smoothed(self.decode_s, seconds)
            return
        decode = (self.decode_s or 0.0) if decoded else 0.0
        # Timing noise must not make a token look free: at least half the step is its prefill.
        prefill = max(seconds - decode, seconds / 2)
        self.token_s = _smoothed(self.token_s, prefill / prompt_tokens)

    def chunk(self, budget_s: float, rows: int, most: int) -> int:
        """Tokens of each of `rows` prompts that fit in `budget_s` of prefill (MIN_CHUNK to
        `most`)."""
        fit = MIN_CHUNK if self.token_s is None else int(budget_s / (self.token_s * max(rows, 1)))
        return min(most, max(MIN_CHUNK, fit))


def step_budget(decode_steps: list[float | None]) -> float:
    """The prefill time a step may take while jobs decode: about one decode step of the slowest
    lane that decodes (its time measured, None while unknown), and at least MIN_STEP_S."""
    known = [s for s in decode_steps if s is not None]
    return max([MIN_STEP_S, *known])
