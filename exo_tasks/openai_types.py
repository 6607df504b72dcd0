"""OpenAI-compatible bodies: chat completions, completions and models.

Pure, like exo_tasks.types. Requests are strict: a field this project does not support is an
error naming it, never silently ignored. They translate into the project's own JobRequest
fields, so the OpenAI routes run through the same queue and runners as POST /v1/jobs.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from exo_tasks.types import FinishReason, MaxTokens, Priority, Usage, WireModel

OpenAIFinishReason = Literal["stop", "length"]
# OpenAI's default for /v1/completions; chat completions take the project's default.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def openai_finish_reason(reason: FinishReason | None) -> OpenAIFinishReason:
    """`stop` only for a natural end (end of sequence or a stop string): output cut short for
    any reason (max_tokens, a cancel, a time limit) is `length`, which clients read as
    "truncated"."""
    return "stop" if reason == "stop" else "length"


# --- requests ---


class StreamOptions(WireModel):
    include_usage: bool = False
    include_obfuscation: Literal[False] = False


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

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions, info: ValidationInfo) -> StreamOptions:
        if not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

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
            },
            exclude_none=True,
        )
        if self.stop is not None:
            fields["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        return fields


class OpenAIChatMessage(WireModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str


class ChatCompletionRequest(OpenAIRequest):
    """Body of POST /v1/chat/completions."""

    messages: list[OpenAIChatMessage]
    max_completion_tokens: MaxTokens | None = None
    logprobs: Literal[False] = False

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
        # `developer` is OpenAI's newer name for the system role.
        fields["messages"] = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.content}
            for m in self.messages
        ]
        return fields


class CompletionRequest(OpenAIRequest):
    """Body of POST /v1/completions: one prompt string (or a list holding exactly one)."""

    prompt: str | list[str]
    echo: Literal[False] = False
    best_of: Literal[1] = 1

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
        return fields


# --- responses ---


class _Choice(BaseModel):
    index: int = 0
    finish_reason: OpenAIFinishReason | None = None
    logprobs: None = None


class _Answer(BaseModel):
    """What every completion, and every chunk of a streamed one, carries."""

    id: str
    created: int
    model: str
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Choice):
    message: AssistantMessage
    finish_reason: OpenAIFinishReason


class ChatCompletion(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


def _absent_when_none(value: object) -> bool:
    return value is None


class Delta(BaseModel):
    """A chunk's increment; unset fields are left out of the JSON, as OpenAI does."""

    role: Literal["assistant"] | None = Field(None, exclude_if=_absent_when_none)
    content: str | None = Field(None, exclude_if=_absent_when_none)


class ChatChunkChoice(_Choice):
    delta: Delta


class ChatCompletionChunk(_Answer):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChoice(_Choice):
    text: str


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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
