"""Client JSON, read one way (exo_tasks.json_input): what it takes, every later step can store
and read back; what it refuses names the field."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from exo_tasks import json_input
from exo_tasks.errors import BadRequest, InvalidRequest


class Wrapped(BaseModel):
    """A record holding a request holding a value, as a job record holds a tool's schema."""

    record: dict[str, Any]


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_the_deepest_json_taken_is_stored_and_read_back_by_pydantic() -> None:
    value = json_input.parse(f'{{"request": {{"tools": [{{"parameters": {nested(60)}}}]}}}}')
    stored = Wrapped(record=value).model_dump_json()  # raised past ~255 levels
    assert Wrapped.model_validate_json(stored).record == value  # raised past ~200 levels


@pytest.mark.parametrize("depth", [65, 300, 5_000])
def test_json_nested_too_deeply_is_400(depth: int) -> None:
    with pytest.raises(BadRequest, match="nested too deeply: more than 64 levels"):
        json_input.parse(nested(depth))
    json_input.parse(nested(64))


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content"),
        ('{"messages": [{"tool_call_id": "\\udfff"}]}', "messages.0.tool_call_id"),
        ('{"metadata": {"\\ud800": "x"}}', "metadata"),
        ('"\\udc00"', None),
    ],
)
def test_a_lone_surrogate_anywhere_is_422_naming_the_field(text: str, field: str | None) -> None:
    with pytest.raises(InvalidRequest, match="lone UTF-16 surrogate") as refused:
        json_input.parse(text)
    assert [d["field"] for d in refused.value.details] == [field]
    # Sent as raw UTF-8 bytes (ED A0 80), Python's json lets them through as well.
    with pytest.raises(InvalidRequest):
        json_input.parse(b'{"prompt": "\xed\xa0\x80"}')


def test_text_that_is_text_is_taken() -> None:
    assert json_input.parse('{"a": "\\ud83d\\ude00 ü"}') == {"a": "😀 ü"}  # a pair is one char
    assert json_input.parse("\ufeff{}".encode()) == {}  # bytes with a BOM, as Flask read them
    for bad in ("{nope", "", b"\xff{}"):
        with pytest.raises(BadRequest, match="not valid JSON"):
            json_input.parse(bad)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_number_that_is_not_finite_is_422_naming_the_field(number: str) -> None:
    """Python's json reads them; pydantic would store NaN as null."""
    with pytest.raises(InvalidRequest, match="must be finite") as refused:
        json_input.parse(f'{{"tools": [{{"parameters": {{"x": {number}}}}}]}}')
    assert [d["field"] for d in refused.value.details] == ["tools.0.parameters.x"]
