"""OpenAI-compatible bodies: chat completions, completions and models.

Pure, like exo_tasks.types. Requests are strict: a field this project does not support is an
error naming it, never silently ignored. They translate into the project's own JobRequest
fields, so the OpenAI routes run through the same queue and runners as POST /v1/jobs.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from exo_tasks.types import (
    MAX_TOP_LOGPROBS,
    FinishReason,
    MaxTokens,
    Priority,
    Usage,
    WireModel,
)
from exo_tasks.wire import TokenLogprob, Tool, ToolCall, absent_when_none

OpenAIFinishReason = Literal["stop", "length", "tool_calls"]
# OpenAI's default for /v1/completions; chat completions take the project's default.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def openai_finish_reason(
    reason: FinishReason | None, tool_calls: list[ToolCall] | None = None
) -> OpenAIFinishReason:
    """`stop` only for a natural end (end of sequence or a stop string), `tool_calls` for one
    after the model called tools: output cut short for any reason (max_tokens, a cancel, a
    time limit) is `length`, which clients read as "truncated"."""
    if reason != "stop":
        return "length"
    return "tool_calls" if tool_calls else "stop"


# --- requests ---


class StreamOptions(WireModel):
    include_usage: bool = False
    include_obfuscation: bool = False  # nothing to obfuscate: chunks are not padded


class TextFormat(WireModel):
    """`response_format`: only plain text (json_object and json_schema would need
    constrained decoding)."""

    type: Literal["text"]


class OpenAIRequest(WireModel):
    """The fields chat completions and completions share."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: MaxTokens | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: Literal[1] = 1
    # What clients send by default: penalties at 0, no bias, who the user is, whether to store.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token ids as strings, as JSON keys are
    user: str | None = None
    store: bool | None = None  # accepted: every job is kept for EXO_JOB_TTL_S anyway
    # mlx_lm.server's sampling extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    # The project's own job fields, as extensions (the openai client's `extra_body`).
    ignore_eos: bool | None = None
    host: str | None = None
    priority: Priority | None = None
    timeout_s: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_absent(cls, data: Any) -> Any:
        # As in OpenAI's API, an explicit null is the default, even for a field we reject.
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @property
    def include_usage(self) -> bool:
        """Only a stream has a usage chunk; clients send stream_options either way."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def job_fields(self) -> dict[str, Any]:
        """The JobRequest fields this request sets (the rest keep the job defaults)."""
        fields = self.model_dump(
            include={
                "model",
                "max_tokens",
                "temperature",
                "top_p",
                "seed",
                "ignore_eos",
                "host",
                "priority",
                "timeout_s",
                "frequency_penalty",
                "presence_penalty",
                "logit_bias",
                "user",
                "top_k",
                "min_p",
                "repetition_penalty",
            },
            exclude_none=True,
        )
        if self.stop is not None:
            fields["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        return fields


def _text_of_parts(value: Any) -> Any:
    """Content given as a list of parts, as many clients send it: the text parts joined."""
    if not isinstance(value, list):
        return value
    texts = []
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"only parts of type 'text' are supported, not {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError("each text part needs a string 'text'")
        texts.append(part["text"])
    return "".join(texts)


class OpenAIChatMessage(WireModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None  # None: an assistant message that only calls tools
    name: str | None = None  # accepted, as OpenAI does; the chat template never sees it
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value: Any) -> Any:
        return _text_of_parts(value)

    def job_message(self) -> dict[str, Any]:
        # `developer` is OpenAI's newer name for the system role.
        message = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.content or "",
        }
        extra = self.model_dump(include={"tool_calls", "tool_call_id"}, exclude_none=True)
        return message | extra


class ChatCompletionRequest(OpenAIRequest):
    """Body of POST /v1/chat/completions."""

    messages: list[OpenAIChatMessage]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: TextFormat | None = None
    tools: list[Tool] | None = None
    # "required" or a named function would need constrained decoding.
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool | None = None  # accepted: every call the model writes is returned

    @field_validator("max_completion_tokens")
    @classmethod
    def _not_both(cls, value: int, info: ValidationInfo) -> int:
        if info.data.get("max_tokens") is not None:
            raise ValueError("give max_completion_tokens or max_tokens, not both")
        return value

    def job_fields(self) -> dict[str, Any]:
        fields = super().job_fields()
        if self.max_completion_tokens is not None:
            fields["max_tokens"] = self.max_completion_tokens
        fields["messages"] = [m.job_message() for m in self.messages]
        fields |= self.model_dump(
            include={"logprobs", "top_logprobs", "tool_choice"}, exclude_none=True
        )
        if self.tools is not None:
            fields["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
        return fields


class CompletionRequest(OpenAIRequest):
    """Body of POST /v1/completions: one prompt string (or a list holding exactly one)."""

    prompt: str | list[str]
    echo: Literal[False] = False
    best_of: Literal[1] = 1
    # OpenAI's completions take the number of top tokens to return (true: just the token's).
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _flag(cls, value: Any) -> Any:
        # As mlx_lm.server takes it: true for the tokens' own, false for none.
        return {True: 0, False: None}.get(value, value) if isinstance(value, bool) else value

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("exactly one prompt per request is supported")
        return value

    def job_fields(self) -> dict[str, Any]:
        fields = super().job_fields()
        fields.setdefault("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
        fields["prompt"] = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        if self.logprobs is not None:
            fields |= {"logprobs": True, "top_logprobs": self.logprobs}
        return fields


# --- responses ---


class _Choice(BaseModel):
    index: int = 0
    finish_reason: OpenAIFinishReason | None = None


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """The completions API's older shape of the same numbers."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]

    @classmethod
    def of(cls, entries: list[TokenLogprob], offset: int = 0) -> CompletionLogprobs:
        """`offset`: where the first entry's token starts in the whole text."""
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry.token)
        return cls(
            tokens=[e.token for e in entries],
            token_logprobs=[e.logprob for e in entries],
            top_logprobs=[{t.token: t.logprob for t in e.top_logprobs} for e in entries],
            text_offset=offsets,
        )


class _Answer(BaseModel):
    """What every completion, and every chunk of a streamed one, carries."""

    id: str
    created: int
    model: str
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the model only called tools, as OpenAI answers
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=absent_when_none)


class ChatChoice(_Choice):
    message: AssistantMessage
    finish_reason: OpenAIFinishReason
    logprobs: ChatLogprobs | None = None


class ChatCompletion(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class DeltaToolCall(ToolCall):
    """A tool call in a stream, whole in one chunk, with its place among the answer's calls."""

    index: int


class Delta(BaseModel):
    """A chunk's increment; unset fields are left out of the JSON, as OpenAI does."""

    role: Literal["assistant"] | None = Field(None, exclude_if=absent_when_none)
    content: str | None = Field(None, exclude_if=absent_when_none)
    tool_calls: list[DeltaToolCall] | None = Field(None, exclude_if=absent_when_none)


class ChatChunkChoice(_Choice):
    delta: Delta
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Answer):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None


class Completion(_Answer):
    """A completion, and also each chunk of a streamed one (OpenAI uses one shape for both)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "exo_tasks"
    hosts: list[str] = Field(description="The hosts whose runner serves this model now.")
    instances: list[str] = Field(
        default_factory=list, description="The instances across hosts that serve it."
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
