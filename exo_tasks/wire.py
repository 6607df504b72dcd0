"""The base of the wire models, and the parts of chat a job carries besides text: the tools it
offers the model, the calls the model makes, the log probabilities it reports.

Pure, like exo_tasks.types (which re-exports these).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def absent_when_none(value: object) -> bool:
    """For `Field(exclude_if=...)`: leave an unset optional field out of the JSON."""
    return value is None


class WireModel(BaseModel):
    """Strict, so a typo or a wrong type in a request is an error naming the field, never a
    silent default or a coercion ("5" or 5.0 as an int, "yes" as a bool); every float finite
    (Python's JSON parser takes NaN, Infinity and 1e999)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _token_id(value: Any) -> Any:
    # JSON object keys are strings: {"42": -100} biases token 42.
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return value


TokenId = Annotated[int, BeforeValidator(_token_id), Field(ge=0)]


class ToolCallFunction(WireModel):
    name: str = Field(min_length=1)
    arguments: str = Field(description="The call's arguments, a JSON object as a string.")


class ToolCall(WireModel):
    """A call of one of the request's tools, in the model's output or an earlier message."""

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class FunctionSpec(WireModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(WireModel):
    """A tool the model may call, rendered into the prompt by the model's chat template."""

    type: Literal["function"] = "function"
    function: FunctionSpec


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    """One output token's log probability, and the most likely tokens at its place."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)
