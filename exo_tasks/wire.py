"""The base of the wire models, and the parts of chat a job carries besides text: the tools it
offers the model, the calls the model makes, the log probabilities it reports.

Pure, like exo_tasks.types (which re-exports these).
"""

from __future__ import annotations

import math
import struct
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)


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


# model_dump_json(context=STORED): the form a job's records and events are kept in, in Redis.
STORED = {"stored": True}


def _stored(info: SerializationInfo) -> bool:
    return bool(info.context and info.context.get("stored"))


def _float32(logprob: float) -> float:
    """A log probability as the float32 it was computed in, in the fewest digits that give
    that float32 back (-2.3025851, not -2.302585124969482): what numpy's `str(np.float32(x))`
    shows, without numpy, which every process that imports this module (the worker's, the
    API's, Flower's) held for it alone: ~8 MiB each, and the worker's thread for OpenBLAS."""
    single = _as_float32(logprob)
    if not math.isfinite(single) or single == 0:
        return single
    for digits in range(1, 10):
        mantissa, exponent = f"{single:.{digits - 1}e}".split("e")
        nearest = int(mantissa.replace(".", ""))
        scale = int(exponent) - digits + 1
        # The nearest decimal of that many digits, or, beside a power of two (where the
        # float32s below are closer together than those above), the next one up or down.
        for candidate in (nearest, nearest - 1, nearest + 1):
            shown = float(f"{candidate}e{scale}")
            if _as_float32(shown) == single:
                return shown
    return single  # not reached: 9 digits give back any float32


def _as_float32(value: float) -> float:
    """`value` rounded to the nearest float32 (to nearest, ties to even)."""
    single: float = struct.unpack("f", struct.pack("f", value))[0]
    return single


class TopLogprob(BaseModel):
    """Kept as `[token, logprob]`: `bytes` are the token's UTF-8, given back on reading
    (a token with 20 alternatives took 1.2 KB as objects, 0.3 KB as lists)."""

    token: str
    logprob: float
    bytes: list[int]

    @model_validator(mode="before")
    @classmethod
    def _from_stored(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) == 2:
            return {"token": value[0], "logprob": value[1], "bytes": list(str(value[0]).encode())}
        return value

    @model_serializer(mode="wrap")
    def _to_stored(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        return [self.token, _float32(self.logprob)] if _stored(info) else handler(self)


class TokenLogprob(TopLogprob):
    """One output token's log probability, and the most likely tokens at its place; kept as
    `[token, logprob, [[token, logprob], ...]]`."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _from_stored(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) == 3:
            token, logprob, top = value
            return {
                "token": token,
                "logprob": logprob,
                "bytes": list(str(token).encode()),
                "top_logprobs": top,
            }
        return value

    @model_serializer(mode="wrap")
    def _to_stored(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        if not _stored(info):
            return handler(self)
        top = [[t.token, _float32(t.logprob)] for t in self.top_logprobs]
        return [self.token, _float32(self.logprob), top]
