"""A job in a runner's batch: its record, its time limits by the runner's clock, and what it has
generated so far."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from exo_tasks import metrics
from exo_tasks.runner.outbox import Outbox
from exo_tasks.types import FinishReason, JobRecord, JobStatus, TokenEvent, utcnow
from exo_tasks.wire import TokenLogprob, ToolCall

if TYPE_CHECKING:  # the engine imports MLX
    from exo_tasks.runner.lane import TokenDelta

# How a job ends: (status, finish reason, error).
Ending = tuple[JobStatus, FinishReason | None, str | None]
Expiry = tuple[JobStatus, FinishReason, str | None]  # past a time limit
HARD_LIMIT: Expiry = (JobStatus.FAILED, "time_limit", "hard time limit exceeded")
SOFT_LIMIT: Expiry = (JobStatus.TIMED_OUT, "time_limit", None)
# What a token event costs in Redis beyond its text and log probabilities (the stream entry,
# its id, the JSON around them), and each log probability beyond its token (the number and
# the JSON around it): measured on stored jobs (75 and 20 bytes), rounded up.
EVENT_BYTES = 80
LOGPROB_BYTES = 24


@dataclass
class ActiveJob:
    record: JobRecord
    soft_deadline: float  # time.time()
    deadline: float
    max_bytes: int  # EXO_MAX_JOB_BYTES
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    last_token_at: datetime | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    stored_bytes: int = 0  # what the job keeps in Redis, so far

    def __post_init__(self) -> None:
        request = self.record.request
        texts = [request.prompt or "", *(m.content for m in request.messages or [])]
        self.stored_bytes = sum(len(text.encode()) for text in texts)

    @property
    def awaiting_first_token(self) -> bool:
        return self.record.first_token_at is None

    def expiry(self, now: float) -> Expiry | None:
        """How the job ends if it is past a time limit at `now`, else None."""
        if now > self.deadline:
            return HARD_LIMIT
        if now > self.soft_deadline:
            return SOFT_LIMIT
        return None

    def take(self, delta: TokenDelta, now: datetime, outbox: Outbox) -> TokenEvent | None:
        """Count the job's step (its latency metrics too); the event for its new text, if any."""
        if self.record.first_token_at is None:
            self.record.first_token_at = now
            outbox.observe(metrics.TIME_TO_FIRST_TOKEN, now - self.record.created_at)
        elif self.last_token_at is not None and delta.completion_tokens > self.completion_tokens:
            new = delta.completion_tokens - self.completion_tokens
            outbox.observe(metrics.INTER_TOKEN_LATENCY, (now - self.last_token_at) / new, new)
        if delta.cached_tokens is not None:
            self._cache_lookup(delta.cached_tokens, outbox)
        self.last_token_at = now
        self.completion_tokens = delta.completion_tokens
        self.logprobs += delta.logprobs
        self.tool_calls += delta.tool_calls
        if not (delta.text or delta.logprobs or delta.tool_calls):
            return None
        self.stored_bytes += 2 * _stored_bytes(delta)  # in its event stream and its record
        self.text.append(delta.text)
        return delta.event(len(self.text) - 1)

    def over_storage(self) -> Ending | None:
        """How the job ends if it keeps more than EXO_MAX_JOB_BYTES in Redis, else None."""
        if self.stored_bytes <= self.max_bytes:
            return None
        error = (
            f"the job's prompt and output take more than {self.max_bytes} bytes of storage "
            f"(EXO_MAX_JOB_BYTES) after {self.completion_tokens} tokens; ask for fewer "
            "max_tokens or top_logprobs"
        )
        return (JobStatus.FAILED, None, error)

    def _cache_lookup(self, cached_tokens: int, outbox: Outbox) -> None:
        """The job's prompt looked up in the prompt cache: in its usage and the counters."""
        usage = self.record.usage
        details = usage.prompt_tokens_details.model_copy(update={"cached_tokens": cached_tokens})
        self.record.usage = usage.model_copy(update={"prompt_tokens_details": details})
        outbox.count(metrics.PREFIX_CACHE_QUERIES, usage.prompt_tokens)
        outbox.count(metrics.PREFIX_CACHE_HITS, cached_tokens)

    def ended(self, status: JobStatus, reason: FinishReason | None, error: str | None) -> JobRecord:
        return self.record.ended(
            status,
            text="".join(self.text),
            finish_reason=reason,
            completion_tokens=self.completion_tokens,
            error=error,
            logprobs=self.logprobs,
            tool_calls=self.tool_calls,
        )


def take_step(
    active: dict[str, ActiveJob], deltas: list[TokenDelta], outbox: Outbox
) -> list[tuple[str, Ending]]:
    """Count one engine step to the jobs in it, their new text into the outbox; the jobs the
    step ended (the engine has already taken them out), with how."""
    endings: list[tuple[str, Ending]] = []
    now = utcnow()
    for delta in deltas:
        job = active.get(delta.job_id)
        if job is None:
            continue
        if delta.error is not None:  # the engine took the job out: its step failed
            endings.append((delta.job_id, (JobStatus.FAILED, None, delta.error)))
            continue
        token = job.take(delta, now, outbox)
        if token is not None:
            outbox.tokens.append((delta.job_id, token))
        if delta.finish_reason is not None:
            endings.append((delta.job_id, (JobStatus.SUCCEEDED, delta.finish_reason, None)))
    return endings


def _stored_bytes(delta: TokenDelta) -> int:
    """About what a step's event keeps in Redis (exo_tasks.wire's stored form)."""
    entries = [(lp.token, *(t.token for t in lp.top_logprobs)) for lp in delta.logprobs]
    tokens = [token for entry in entries for token in entry]
    calls = sum(len(call.model_dump_json()) for call in delta.tool_calls)
    text = len(delta.text.encode()) + sum(len(token.encode()) for token in tokens)
    return EVENT_BYTES + text + LOGPROB_BYTES * len(tokens) + calls
