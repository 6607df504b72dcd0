"""A batch's input file, checked the way OpenAI checks it before a batch starts. Pure.

What fails the whole file (the batch ends `failed`, its `errors` naming each line): a line that
is not a JSON object, one without a string `custom_id` or with one used before, a `method` other
than POST, a `url` other than the batch's endpoint, a `body` that is not an object, no request
at all, or more than EXO_BATCH_MAX_LINES of them. What fails only its own line (the error file,
with the answer the endpoint gives that request directly): a body the endpoint refuses (a
string in it that is not text, nesting too deep, a wrong field), a model no host serves.

The check and the feeder read a line with the same parser (exo_tasks.json_input): a line the
check took is a line the feeder can read. A file saved with a UTF-8 byte order mark is read
from after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from exo_tasks import json_input
from exo_tasks.batch_types import BatchError
from exo_tasks.errors import ExoError

# An input with many bad lines reports the first ones only.
MAX_REPORTED_ERRORS = 50
BOM = "\ufeff".encode()


class UnreadableLine(ExoError):
    """A line of a running batch's input that cannot be read (its file was deleted)."""

    status = 400
    type = "invalid_line"


class InputLine(BaseModel):
    """One request of a batch, as the feeder reads it back."""

    custom_id: str
    body: dict[str, Any]


@dataclass
class CheckedInput:
    """The byte span of each request line (blank lines are skipped), or why the file fails."""

    spans: list[tuple[int, int]] = field(default_factory=list)
    errors: list[BatchError] = field(default_factory=list)

    def fail(self, code: str, message: str, line: int | None, param: str | None = None) -> None:
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(BatchError(code=code, message=message, line=line, param=param))


def check(content: bytes, endpoint: str, max_lines: int) -> CheckedInput:
    checked = CheckedInput()
    seen: set[str] = set()
    start = len(BOM) if content.startswith(BOM) else 0
    for number, raw in enumerate(content[start:].split(b"\n"), start=1):
        end = start + len(raw)
        if raw.strip():
            checked.spans.append((start, end))
            custom_id = _check_line(raw.decode(), endpoint, number, checked)
            if custom_id is not None and custom_id in seen:
                message = f"custom_id '{custom_id}' is used by an earlier line"
                checked.fail("duplicate_custom_id", message, number, "custom_id")
            seen.add(custom_id or "")
        start = end + 1
    if not checked.spans:
        checked.fail("empty_file", "the input file holds no request", None)
    elif len(checked.spans) > max_lines:
        message = f"{len(checked.spans)} requests, more than {max_lines} (EXO_BATCH_MAX_LINES)"
        checked.fail("too_many_requests", message, None)
    return checked


def _check_line(raw: str, endpoint: str, number: int, checked: CheckedInput) -> str | None:
    """The line's custom_id if it has one; each problem recorded in `checked`."""
    try:
        line = json_input.loads(raw)
    except ExoError as exc:
        checked.fail("invalid_json_line", f"this line is {exc.message}", number)
        return None
    if not isinstance(line, dict):
        checked.fail("invalid_json_line", "this line is not a JSON object", number)
        return None
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        message = "custom_id must be a non-empty string"
        checked.fail("missing_required_parameter", message, number, "custom_id")
        custom_id = None
    elif json_input.SURROGATE.search(custom_id):  # it is written in the output files
        message = "custom_id holds a lone UTF-16 surrogate, which is not text"
        checked.fail("invalid_custom_id", message, number, "custom_id")
        custom_id = None
    if line.get("method") != "POST":
        checked.fail("invalid_method", "method must be 'POST'", number, "method")
    if line.get("url") != endpoint:
        message = f"url must be the batch's endpoint '{endpoint}'"
        checked.fail("mismatched_endpoint", message, number, "url")
    if not isinstance(line.get("body"), dict):
        checked.fail("invalid_body", "body must be a JSON object", number, "body")
    return custom_id


def read_line(raw: str, line: int) -> InputLine:
    """Line `line` (0-based), which the check accepted; UnreadableLine if it cannot be read
    now (its file deleted since)."""
    try:
        return InputLine.model_validate(json_input.loads(raw))
    except (ExoError, ValidationError):
        raise UnreadableLine(f"line {line + 1} of the input file cannot be read") from None


def custom_id_of(raw: str, line: int) -> str:
    """The line's custom_id; none ('') if it cannot be read now: the line still gets its
    result, in its place."""
    try:
        return read_line(raw, line).custom_id
    except UnreadableLine:
        return ""
