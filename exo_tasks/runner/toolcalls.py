"""The chat template's side of a job: its messages and tools in as prompt tokens, and tool calls
out of its streamed text, as mlx_lm.server finds them: the text between the model's tool-call
markers (mlx-lm's tokenizer knows them from the chat template) goes to the model's tool parser,
the rest stays text.

Pure: the tokenizer and the parser are handed in, so this imports no MLX.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

from exo_tasks.types import ChatMessage, SamplingParams
from exo_tasks.wire import Tool, ToolCall, ToolCallFunction

ToolParser = Callable[[str, Any], Any]  # mlx-lm's parse_tool_call(text, tools)
log = logging.getLogger("exo_tasks.toolcalls")


def held_back(text: str, since: int, patterns: list[str]) -> int:
    """Length of the longest tail of `text[since:]` that could still grow into one of
    `patterns`: text that must wait for more before it is handed out."""
    longest = 0
    for pattern in patterns:
        for k in range(min(len(pattern) - 1, len(text) - since), longest, -1):
            if text.endswith(pattern[:k]):
                longest = k
                break
    return longest


class ToolCallSplitter:
    """One job's text in, its plain text and its parsed tool calls out."""

    def __init__(self, start: str, end: str, parse: ToolParser, tools: list[dict[str, Any]]):
        self.start, self.end = start, end
        self.parse, self.tools = parse, tools
        self.pending = ""  # text not handed out yet: a possible marker, or a call's body
        self.inside = False

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """Take newly published text; return the plain text and the calls it completed."""
        self.pending += text
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            marker = self.end if self.inside else self.start
            at = self.pending.find(marker)
            if at < 0:
                break
            if self.inside:
                calls.extend(self._calls(self.pending[:at]))
            else:
                out.append(self.pending[:at])
            self.pending = self.pending[at + len(marker) :]
            self.inside = not self.inside
        if self.inside and final:  # the output ended inside a call (max_tokens)
            calls.extend(self._calls(self.pending))
            self.pending = ""
        elif not self.inside:
            keep = 0 if final else held_back(self.pending, 0, [self.start])
            out.append(self.pending[: len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep :]
        return "".join(out), calls

    def _calls(self, body: str) -> list[ToolCall]:
        """The calls in one marked span; none if the model wrote no valid call there."""
        try:
            parsed = self.parse(body, self.tools)
        except (ValueError, TypeError, KeyError) as exc:  # json.JSONDecodeError is a ValueError
            log.warning("the model wrote a tool call that does not parse: %r", exc)
            return []
        found = parsed if isinstance(parsed, list) else [parsed]
        return [_tool_call(call) for call in found if isinstance(call, dict) and "name" in call]


def _tool_call(call: dict[str, Any]) -> ToolCall:
    arguments = call.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(
        id=str(call.get("id") or f"call_{uuid.uuid4().hex[:24]}"),
        function=ToolCallFunction(name=str(call["name"]), arguments=arguments),
    )


def encode(
    tokenizer: Any,  # mlx-lm's TokenizerWrapper
    prompt: str | None,
    messages: list[ChatMessage] | None,
    tools: list[Tool] | None,
) -> list[int]:
    """Prompt tokens for a raw prompt, or for chat messages (and the tools the model may call)
    through the chat template."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of 'prompt' or 'messages'")
    if prompt is not None:
        return list(tokenizer.encode(prompt))
    if tools and not tokenizer.has_tool_calling:
        raise ValueError("tools: the model's chat template has no tool support")
    chat = [_template_message(m) for m in messages or []]
    specs = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    return list(tokenizer.apply_chat_template(chat, tools=specs, add_generation_prompt=True))


def splitter(tokenizer: Any, params: SamplingParams) -> ToolCallSplitter | None:
    """What takes a job's tool calls out of its text, if it gave tools to call."""
    if not (params.parses_tool_calls and tokenizer.has_tool_calling):
        return None
    specs = [tool.model_dump(exclude_none=True) for tool in params.tools or []]
    t = tokenizer
    return ToolCallSplitter(t.tool_call_start, t.tool_call_end, t.tool_parser, specs)


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: a tool call's arguments as an object, as
    mlx_lm.server gives them."""
    out = message.model_dump(exclude_none=True)
    for call in out.get("tool_calls", []):
        with contextlib.suppress(ValueError):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out
