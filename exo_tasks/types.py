"""Typed messages that cross a process boundary: API, Redis, pool children, runners.

Pure: imports neither redis nor mlx, so every process (and every unit test) can use it.
"""

from __future__ import annotations

import enum
import math
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from exo_tasks import limits

# Names live in exo_tasks.naming; these stay importable from here for older imports.
from exo_tasks.naming import host_queue as host_queue
from exo_tasks.naming import model_queue as model_queue
from exo_tasks.naming import runner_id_for as runner_id_for
from exo_tasks.wire import TokenId, TokenLogprob, Tool, ToolCall, absent_when_none
from exo_tasks.wire import WireModel as WireModel  # importable from here, as before

FinishReason = Literal["stop", "length", "cancelled", "time_limit", "shutdown"]
Priority = Literal["high", "normal", "low"]
MAX_STOP_STRINGS = 4
# The most jobs one page of GET /v1/jobs lists (its `limit`; the CLI's `jobs --limit` too).
MAX_LIST_LIMIT = 1000
# mx.random.key takes an unsigned 64-bit seed; a larger one raises TypeError in the runner.
SEED_LIMIT = 1 << 64
# Every chat template marks each message (its role at least) with one token or more, so a
# request with more messages than the prompt token cap is over it, whatever the tokenizer.
MIN_TOKENS_PER_MESSAGE = 1
MAX_LOGIT_BIAS = 300  # as OpenAI
MAX_TOP_LOGPROBS = 20  # as OpenAI
MAX_TOOLS = 128  # as OpenAI


def utcnow() -> datetime:
    return datetime.now(UTC)


class JobStatus(enum.StrEnum):
    """A job's status on the wire and in Redis. Which status may follow which is
    exo_tasks.lifecycle's transitions table."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    @property
    def is_terminal(self) -> bool:
        return self not in (JobStatus.QUEUED, JobStatus.RUNNING)


TERMINAL_JOB_STATUSES: frozenset[JobStatus] = frozenset(s for s in JobStatus if s.is_terminal)


class ChatMessage(WireModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant's tool calls.")
    tool_call_id: str | None = Field(None, description="The call a `tool` message answers.")


def _within_max_tokens_cap(value: int, info: ValidationInfo) -> int:
    # The cap is configuration (EXO_MAX_TOKENS): the API passes it as validation context.
    cap = (info.context or {}).get("max_tokens_cap")
    if cap is not None and value > cap:
        raise ValueError(f"must be at most {cap} (EXO_MAX_TOKENS)")
    return value


MaxTokens = Annotated[int, Field(ge=1), AfterValidator(_within_max_tokens_cap)]


def _within_stop_chars_cap(value: str, info: ValidationInfo) -> str:
    # The runner looks for every stop string after every token: its length is CPU per token.
    cap = (info.context or {}).get("max_stop_chars")
    if cap is not None and len(value) > cap:
        raise ValueError(f"is {len(value)} characters; at most {cap} (EXO_MAX_STOP_CHARS)")
    return value


StopString = Annotated[str, Field(min_length=1), AfterValidator(_within_stop_chars_cap)]
Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT)]


class SamplingParams(WireModel):
    """What the runner needs to generate for one job."""

    max_tokens: MaxTokens = 256
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: Seed | None = None
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    ignore_eos: bool = False
    # As mlx_lm.server: filters before sampling (0: off), and logits processors per job.
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    logit_bias: dict[TokenId, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="Added to the logits of these token ids."
    )
    repetition_penalty: float = Field(
        0.0, ge=0.0, le=10.0, description="Multiplicative, over the last 20 tokens; 0 or 1: off."
    )
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logprobs: bool = Field(False, description="Return each output token's log probability.")
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none"] = Field(
        "auto", description="`none`: the tools are shown to the model, its output is text."
    )

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int, info: ValidationInfo) -> int:
        if value and not info.data.get("logprobs"):
            raise ValueError("needs logprobs to be true")
        return value

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def outside_vocabulary(self, vocab_size: int) -> tuple[str, str] | None:
        """The field and why, if it asks for what the model's vocabulary rules out: such a
        job would make a shared sampler, or the whole batch's step, raise."""
        if self.top_k >= vocab_size:
            return "top_k", f"must be below the vocabulary size ({vocab_size})"
        outside = sorted(token for token in self.logit_bias or {} if token >= vocab_size)
        if outside:
            return "logit_bias", (
                f"token ids {outside[:5]} are outside the vocabulary (size {vocab_size})"
            )
        return None


class JobRequest(SamplingParams):
    """Body of POST /v1/jobs."""

    # Exactly one of prompt and messages, said in the schema too (GET /openapi.json).
    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        }
    )

    model: str | None = None
    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    host: str | None = Field(None, min_length=1)
    priority: Priority = "normal"
    timeout_s: float | None = Field(
        None, description="The job's soft time limit in seconds; capped below redelivery."
    )
    user: str | None = Field(
        None, max_length=256, description="Who the job is for, as the client names them; kept."
    )
    keep_alive: float | None = Field(
        None,
        description="Seconds the model stays loaded once the runner is idle after this job "
        "(Ollama's keep_alive): 0 unloads at once, negative never; unset: "
        "EXO_RUNNER_IDLE_UNLOAD_S.",
    )

    @field_validator("timeout_s")
    @classmethod
    def _timeout_within_cap(cls, value: float | None, info: ValidationInfo) -> float | None:
        # The cap follows from configuration (exo_tasks/limits.py), passed as context.
        if value is None:
            return value
        return limits.check_timeout(value, (info.context or {}).get("max_timeout_s", math.inf))

    @field_validator("prompt", "messages")
    @classmethod
    def _prompt_within_caps(
        cls, value: str | list[ChatMessage] | None, info: ValidationInfo
    ) -> str | list[ChatMessage] | None:
        # Like max_tokens: the caps are configuration (EXO_MAX_PROMPT_CHARS and
        # EXO_MAX_PROMPT_TOKENS), passed as context.
        caps = info.context or {}
        if value is None:
            return value
        chars = len(value) if isinstance(value, str) else sum(len(m.content) for m in value)
        cap = caps.get("max_prompt_chars")
        if cap is not None and chars > cap:
            raise ValueError(f"is {chars} characters; at most {cap} (EXO_MAX_PROMPT_CHARS)")
        # Exact only where the tokenizer is (the runner); here what is certainly over.
        cap = caps.get("max_prompt_tokens")
        tokens = 0 if isinstance(value, str) else len(value) * MIN_TOKENS_PER_MESSAGE
        if cap is not None and tokens > cap:
            raise ValueError(
                f"is at least {tokens} tokens after the chat template ({len(value)} messages); "
                f"at most {cap} (EXO_MAX_PROMPT_TOKENS)"
            )
        return value

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> Self:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class JobOutput(BaseModel):
    text: str = ""
    finish_reason: FinishReason | None = None
    # Set only when the request asked for them (logprobs) or gave tools the model called.
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCall] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(
        0, description="Prompt tokens whose KV state came from the runner's prompt cache."
    )


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class Timings(BaseModel):
    queue_ms: float | None = None
    ttft_ms: float | None = None
    tokens_per_s: float | None = None


class JobEnding(BaseModel):
    """A job but its request: how it ended, as its done event carries it. Its record keeps the
    request (a 100,000-character prompt was kept three times over) and the logprobs."""

    id: str
    status: JobStatus = JobStatus.QUEUED
    model: str
    host: str | None = None
    runner_id: str | None = None
    instance: str | None = Field(
        None, description="The instance that serves the job's model, if no host holds it whole."
    )
    created_at: datetime = Field(default_factory=utcnow)
    started_at: datetime | None = None
    first_token_at: datetime | None = None
    finished_at: datetime | None = None
    output: JobOutput = Field(default_factory=JobOutput)
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    error: str | None = None
    refused: bool = Field(
        False, description="Failed because its runner refused the job's own input: a client error."
    )
    attempts: int = 0
    owner: str | None = Field(
        None, description="The worker incarnation that holds the current attempt while running."
    )
    direct: bool = Field(
        False,
        description="The current attempt was handed to its runner as the job was submitted "
        "(EXO_DIRECT_HAND_OVER); its task, once delivered, follows it.",
    )

    @property
    def is_terminal(self) -> bool:
        return self.status.is_terminal


class JobRecord(JobEnding):
    """The job as stored in Redis and returned by GET /v1/jobs/<id>."""

    request: JobRequest

    def ended(
        self,
        status: JobStatus,
        *,
        text: str,
        finish_reason: FinishReason | None,
        completion_tokens: int,
        error: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
        tool_calls: list[ToolCall] | None = None,
        refused: bool = False,
    ) -> JobRecord:
        """This job in a terminal status, with usage and timings filled in; `refused`: failed
        for its own input (see JobEnding.refused)."""
        now = utcnow()
        prompt_tokens = self.usage.prompt_tokens
        timings = Timings()
        if self.started_at is not None:
            timings.queue_ms = milliseconds(self.started_at - self.created_at)
        if self.first_token_at is not None and self.started_at is not None:
            timings.ttft_ms = milliseconds(self.first_token_at - self.started_at)
            decode_s = (now - self.first_token_at).total_seconds()
            if completion_tokens > 1 and decode_s > 0:
                timings.tokens_per_s = round((completion_tokens - 1) / decode_s, 2)
        return self.model_copy(
            update={
                "status": JobStatus(status),
                "finished_at": now,
                "output": JobOutput(
                    text=text,
                    finish_reason=finish_reason,
                    logprobs=logprobs if self.request.logprobs else None,
                    tool_calls=tool_calls or None,
                ),
                "usage": self.usage.model_copy(
                    update={
                        "completion_tokens": completion_tokens,
                        "total_tokens": prompt_tokens + completion_tokens,
                    }
                ),
                "timings": timings,
                "error": error,
                "refused": refused,
            }
        )


def milliseconds(delta: timedelta) -> float:
    return round(delta.total_seconds() * 1000, 2)


# --- The job's event stream (Redis stream per job, read by SSE and by the waiting task) ---


class TokenEvent(BaseModel):
    event: Literal["token"] = "token"
    index: int
    text: str
    # The attempt's tokens so far, the EOS included: a step's text can be empty (held back
    # while it may begin a stop string, or the EOS), so events undercount tokens. 0 in
    # streams written before it was added.
    tokens: int = 0
    # Only when the job asked for logprobs, or its output called tools: absent otherwise.
    logprobs: list[TokenLogprob] | None = Field(None, exclude_if=absent_when_none)
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=absent_when_none)


class DoneEvent(BaseModel):
    """The last event of a stream; `event` is `error` when the job failed."""

    event: Literal["done", "error"]
    job: JobEnding  # given a JobRecord, written without its request


class RequeuedEvent(BaseModel):
    """The job went back to the queue (its worker stopped): the text so far is discarded and
    the tokens of the next attempt follow."""

    event: Literal["requeued"] = "requeued"
    attempt: int


JobEvent = Annotated[TokenEvent | DoneEvent | RequeuedEvent, Field(discriminator="event")]
