"""The pure parts of batches: the input file's check (what fails the file, and where each
request is), and the completion window."""

from __future__ import annotations

import json

import pytest

from exo_tasks.batch.input import check, read_line
from exo_tasks.batch.types import window_seconds

URL = "/v1/chat/completions"


def line(custom_id: str, **fields: object) -> bytes:
    body = {"custom_id": custom_id, "method": "POST", "url": URL, "body": {"x": 1}, **fields}
    return json.dumps(body).encode()


def test_spans_point_at_each_request_and_skip_blank_lines() -> None:
    content = line("a") + b"\n\n" + line("b", note="ü") + b"\n"
    checked = check(content, URL, max_lines=10)
    assert not checked.errors
    assert [read_line(content[a:b].decode()).custom_id for a, b in checked.spans] == ["a", "b"]


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    [
        (b"{nope", "invalid_json_line", None),
        (b"[1]", "invalid_json_line", None),
        (line("", method="POST"), "missing_required_parameter", "custom_id"),
        (line("x", method="GET"), "invalid_method", "method"),
        (line("x", url="/v1/embeddings"), "mismatched_endpoint", "url"),
        (line("x", body="text"), "invalid_body", "body"),
    ],
)
def test_a_bad_line_fails_the_file_naming_it(raw: bytes, code: str, param: str | None) -> None:
    checked = check(line("first") + b"\n" + raw + b"\n", URL, max_lines=10)
    assert [(e.code, e.line, e.param) for e in checked.errors] == [(code, 2, param)]


def test_duplicates_empty_files_and_too_many_lines() -> None:
    twice = check(line("a") + b"\n" + line("a"), URL, max_lines=10)
    assert [(e.code, e.line) for e in twice.errors] == [("duplicate_custom_id", 2)]
    assert [e.code for e in check(b"\n \n", URL, max_lines=10).errors] == ["empty_file"]
    many = b"\n".join(line(str(i)) for i in range(4))
    assert [e.code for e in check(many, URL, max_lines=3).errors] == ["too_many_requests"]


def test_many_bad_lines_report_the_first_fifty() -> None:
    assert len(check(b"{\n" * 500, URL, max_lines=1000).errors) == 50


def test_completion_window() -> None:
    assert window_seconds("24h") == 86400 and window_seconds("90m") == 5400
    assert window_seconds("5s") == 5
    for bad in ("25h", "0s", "1d", "24 h", "", "h"):
        with pytest.raises(ValueError):
            window_seconds(bad)
