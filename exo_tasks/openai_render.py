"""How a job reads as an answer of OpenAI's chat completions and completions, whole or as the
chunks of a stream, and as OpenAI's error when it failed. Flask-free: the OpenAI routes
(exo_tasks.api.openai) and the batch results (exo_tasks.batch.results, in the worker) share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel

from exo_tasks.errors import ExoError, InvalidRequest, RunnerGone
from exo_tasks.openai_types import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    DeltaToolCall,
    OpenAIFinishReason,
    openai_finish_reason,
)
from exo_tasks.types import JobEnding, JobRecord, TokenEvent


@dataclass
class Sent:
    """What a stream has sent so far: where the next token's text and tool call start."""

    chars: int = 0
    calls: int = 0

    def add(self, token: TokenEvent) -> None:
        self.chars += len(token.text)
        self.calls += len(token.tool_calls or [])


class Renderer(Protocol):
    """How one route shows a job: whole, or as the chunks of a stream."""

    def whole(self, job: JobEnding) -> BaseModel: ...

    def opening(self, job: JobRecord) -> list[BaseModel]: ...

    def chunk(
        self,
        job: JobRecord,
        token: TokenEvent | None,
        finish: OpenAIFinishReason | None,
        sent: Sent,
    ) -> BaseModel: ...

    def usage_chunk(self, job: JobEnding) -> BaseModel: ...


def _header(job: JobEnding, prefix: str) -> dict[str, Any]:
    """What every chunk of one answer repeats: its id, creation time and model."""
    return {
        "id": f"{prefix}-{job.id}",
        "created": int(job.created_at.timestamp()),
        "model": job.model,
    }


class ChatRenderer:
    def whole(self, job: JobEnding) -> ChatCompletion:
        output = job.output
        calls = output.tool_calls
        choice = ChatChoice(
            message=AssistantMessage(
                content=output.text or (None if calls else ""), tool_calls=calls
            ),
            finish_reason=openai_finish_reason(output.finish_reason, calls),
            logprobs=ChatLogprobs(content=output.logprobs) if output.logprobs is not None else None,
        )
        return ChatCompletion(**_header(job, "chatcmpl"), choices=[choice], usage=job.usage)

    def opening(self, job: JobRecord) -> list[BaseModel]:
        choice = ChatChunkChoice(delta=Delta(role="assistant", content=""))
        return [ChatCompletionChunk(**_header(job, "chatcmpl"), choices=[choice])]

    def chunk(
        self,
        job: JobRecord,
        token: TokenEvent | None,
        finish: OpenAIFinishReason | None,
        sent: Sent,
    ) -> ChatCompletionChunk:
        delta, logprobs = Delta(), None
        if token is not None:
            calls = [
                DeltaToolCall(index=sent.calls + i, **dict(call))
                for i, call in enumerate(token.tool_calls or [])
            ]
            delta = Delta(content=token.text or None, tool_calls=calls or None)
            logprobs = ChatLogprobs(content=token.logprobs) if token.logprobs else None
        choice = ChatChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)
        return ChatCompletionChunk(**_header(job, "chatcmpl"), choices=[choice])

    def usage_chunk(self, job: JobEnding) -> ChatCompletionChunk:
        return ChatCompletionChunk(**_header(job, "chatcmpl"), choices=[], usage=job.usage)


class TextRenderer:
    def whole(self, job: JobEnding) -> Completion:
        output = job.output
        logprobs = CompletionLogprobs.of(output.logprobs) if output.logprobs is not None else None
        choice = CompletionChoice(
            text=output.text,
            finish_reason=openai_finish_reason(output.finish_reason),
            logprobs=logprobs,
        )
        return Completion(**_header(job, "cmpl"), choices=[choice], usage=job.usage)

    def opening(self, job: JobRecord) -> list[BaseModel]:
        return []

    def chunk(
        self,
        job: JobRecord,
        token: TokenEvent | None,
        finish: OpenAIFinishReason | None,
        sent: Sent,
    ) -> Completion:
        text, logprobs = "", None
        if token is not None:
            text = token.text
            if token.logprobs:
                logprobs = CompletionLogprobs.of(token.logprobs, sent.chars)
        choice = CompletionChoice(text=text, finish_reason=finish, logprobs=logprobs)
        return Completion(**_header(job, "cmpl"), choices=[choice])

    def usage_chunk(self, job: JobEnding) -> Completion:
        return Completion(**_header(job, "cmpl"), choices=[], usage=job.usage)


def failure(job: JobEnding) -> ExoError:
    """A failed job: refused for what it asked (the client's error, as the API's own checks
    would answer it), else its runner died, stalled or was shut down before it finished."""
    message = job.error or f"job {job.id} failed"
    if job.refused:
        return InvalidRequest(message, {"job_id": job.id})
    return RunnerGone(message, {"job_id": job.id})
