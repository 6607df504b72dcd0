"""A streaming `POST /v1/chat/completions` client, the same for exo_tasks and mlx_lm.server:
it times every token, and keeps the answer (a conversation resends it) and the usage, cached
prompt tokens included."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from bench.clients import REQUEST_ERRORS, Connection, Trace, _lines
from tests.support import sse


@dataclass
class ChatTrace(Trace):
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    chunks: list[str] = field(default_factory=list)


class ChatClient:
    def __init__(self, base_url: str) -> None:
        self.http = Connection(base_url)

    def run(self, trace: ChatTrace, messages: list[dict[str, str]], max_tokens: int) -> None:
        body = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            response = self.http.open("POST", "/v1/chat/completions", body)
            if response.status != 200:
                raise RuntimeError(f"POST /v1/chat/completions: {response.status}")
            for chunk in sse.chunks(_lines(response)):
                self._chunk(trace, chunk)
            response.read()
            if trace.ended is None:
                raise RuntimeError("the stream ended before the completion did")
            trace.text = "".join(trace.chunks)
        except REQUEST_ERRORS as exc:
            trace.error = f"{type(exc).__name__}: {exc}"
            self.http.reset()

    @staticmethod
    def _chunk(trace: ChatTrace, chunk: dict[str, Any]) -> None:
        usage = chunk.get("usage")
        if usage:
            trace.ended = time.monotonic()
            trace.completion_tokens = usage["completion_tokens"]
            trace.prompt_tokens = usage["prompt_tokens"]
            details = usage.get("prompt_tokens_details") or {}
            trace.cached_tokens = details.get("cached_tokens", 0)
        elif chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
            trace.token_times.append(time.monotonic())
            trace.chunks.append(chunk["choices"][0]["delta"]["content"])
