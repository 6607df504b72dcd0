"""Client JSON, read one way wherever it comes in: a request body, a line of a batch's input
file. Pure.

Python's `json` and pydantic's parser (which reads our own records back) disagree: pydantic's
refuses a lone UTF-16 surrogate (`"\\ud800"`) and nesting past about 200 levels, and pydantic
cannot even write a lone surrogate or nesting past about 255 levels (and writes NaN as null).
So what comes in is read here, once, and refused unless every later step can store it and
read it back as it was: nesting is capped at MAX_DEPTH, every string (and key) must be one
UTF-8 can hold, every number finite (Python's `json` reads NaN, Infinity and 1e999).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from exo_tasks.errors import BadRequest, InvalidRequest

# Well below pydantic's ~200 levels, with room for the records that wrap a request (a job
# holds the request, which holds its tools, which hold a JSON schema); far above any schema
# people write (OpenAI's structured outputs allow 10 levels of objects).
MAX_DEPTH = 64
SURROGATE = re.compile("[\ud800-\udfff]")


def parse(text: str | bytes) -> Any:
    """The JSON value of `text`, if every later step can keep it: loads() and check()."""
    value = loads(text)
    check(value)
    return value


def loads(text: str | bytes) -> Any:
    """The JSON value of `text` (bytes: UTF-8, a leading BOM allowed, as Python's `json`
    reads them); BadRequest (400) if it is not JSON."""
    try:
        return json.loads(text)
    except RecursionError:  # Python's parser recurses once per level
        raise BadRequest(_too_deep(), {"field": None}) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise BadRequest(f"not valid JSON: {exc}", {"field": None}) from None


def check(value: Any) -> None:
    """BadRequest (400) if `value` nests deeper than MAX_DEPTH, InvalidRequest (422, naming
    the field) if a string or key in it holds a lone surrogate or a number is not finite.
    Walks without recursion."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), value)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, str):
            _check_string(node, path)
            continue
        if isinstance(node, float) and not math.isfinite(node):
            _refuse(path, "a number must be finite (NaN, Infinity and 1e999 are not)")
        if not isinstance(node, dict | list):
            continue
        if len(path) >= MAX_DEPTH:
            raise BadRequest(_too_deep(), {"field": None})
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, item in items:
            if isinstance(key, str):
                _check_string(key, path, is_key=True)
            stack.append(((*path, str(key)), item))


def _check_string(text: str, path: tuple[str, ...], *, is_key: bool = False) -> None:
    if SURROGATE.search(text) is not None:
        what = "a key" if is_key else "a string"
        _refuse(path, f"{what} holds a lone UTF-16 surrogate (such as \\ud800), which is not text")


def _refuse(path: tuple[str, ...], message: str) -> None:
    """422 naming the field, in the shape of a validation error's details."""
    field = ".".join(path) or None
    details = [{"field": field, "message": message}]
    raise InvalidRequest(f"{field}: {message}" if field else message, details)


def _too_deep() -> str:
    return f"the JSON is nested too deeply: more than {MAX_DEPTH} levels"
