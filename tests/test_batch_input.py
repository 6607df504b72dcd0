"""The pure parts of batches: the input file's check (what fails the file, and where each
request is), and the completion window."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exo_tasks import json_input
from exo_tasks.batch.input import UnreadableLine, check, read_line
from exo_tasks.batch_types import window_seconds
from exo_tasks.errors import BadRequest, ExoError, InvalidRequest

URL = "/v1/chat/completions"


def line(custom_id: str, **fields: object) -> bytes:
    body = {"custom_id": custom_id, "method": "POST", "url": URL, "body": {"x": 1}, **fields}
    return json.dumps(body).encode()


def test_spans_point_at_each_request_and_skip_blank_lines() -> None:
    content = line("a") + b"\n\n" + line("b", note="ü") + b"\n"
    checked = check(content, URL, max_lines=10)
    assert not checked.errors
    assert [read_line(content[a:b].decode(), 0).custom_id for a, b in checked.spans] == ["a", "b"]


def nested(depth: int) -> object:
    value: object = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_every_line_the_check_takes_the_feeder_reads() -> None:
    """The check read with Python's json, the feeder with pydantic's parser: a lone surrogate,
    a byte order mark or 300 levels of nesting passed the one and failed the other, every
    tick, for every batch. Now both read with one parser; what the body holds that no endpoint
    takes is its line's error (the endpoint's own answer), found when the line is sent."""
    surrogate = b'{"custom_id": "s", "method": "POST", "url": "%s", ' % URL.encode()
    surrogate += b'"body": {"messages": [{"role": "user", "content": "\\ud800"}]}}'
    deep = line("deep", body={"x": nested(300)})
    content = "\ufeff".encode() + line("bom") + b"\n" + surrogate + b"\n" + deep + b"\n"
    checked = check(content, URL, max_lines=10)
    assert not checked.errors
    read = [read_line(content[a:b].decode(), n) for n, (a, b) in enumerate(checked.spans)]
    assert [r.custom_id for r in read] == ["bom", "s", "deep"]
    with pytest.raises(InvalidRequest) as refused:
        json_input.check(read[1].body)
    assert [d["field"] for d in refused.value.details] == ["messages.0.content"]
    with pytest.raises(BadRequest, match="nested too deeply"):
        json_input.check(read[2].body)


def test_a_line_that_cannot_be_read_now_says_which() -> None:
    """Its file deleted since the check (a span read from nothing is ''): the feeder makes it
    an error line of its batch, naming the line, instead of raising in its tick."""
    with pytest.raises(UnreadableLine, match="line 4 of the input file cannot be read"):
        read_line("", 3)


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        ("\ufeff".encode() + line("bom-mid-file"), "invalid_json_line"),
        (
            line("deep", body={"x": []}).replace(b"[]", b"[" * 5_000 + b"]" * 5_000),
            "invalid_json_line",
        ),
        (line("\ud800"), "invalid_custom_id"),
    ],
)
def test_what_no_step_can_read_fails_the_file_at_the_check(raw: bytes, code: str) -> None:
    checked = check(line("first") + b"\n" + raw + b"\n", URL, max_lines=10)
    assert [(e.code, e.line) for e in checked.errors] == [(code, 2)]


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


# Pieces of hostile lines: text with lone surrogates, byte order marks, deep nesting, odd
# escapes and numbers, joined into lines that may or may not be JSON.
PIECES = st.one_of(
    st.text(max_size=8),
    st.sampled_from(['"\\ud800"', '"\\udfff"', "\ufeff", "NaN", "1e999", '"\\u0000"', "\\", '"']),
    st.integers(1, 400).map(lambda depth: "[" * depth + "]" * depth),
)


@st.composite
def hostile_lines(draw: st.DrawFn) -> bytes:
    body = "{" + ", ".join(f'"k{i}": {draw(PIECES)}' for i in range(draw(st.integers(0, 3)))) + "}"
    custom_id = draw(st.one_of(st.just('"id"'), PIECES))
    prefix = draw(st.sampled_from(["", "\ufeff", " "]))
    return (
        f'{prefix}{{"custom_id": {custom_id}, "method": "POST", "url": "{URL}", "body": {body}}}'
    ).encode()


@given(lines=st.lists(hostile_lines(), min_size=1, max_size=4))
@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_whatever_the_check_takes_the_feeder_reads_and_stores(lines: list[bytes]) -> None:
    """The property behind the first finding: a file the check takes never raises where the
    feeder reads it; a body either passes the door (json_input.check) or is refused with an
    ExoError (its line's answer), and what passes can be stored by pydantic."""
    content = b"\n".join(lines)
    checked = check(content, URL, max_lines=10)
    if checked.errors:
        return
    for number, (start, end) in enumerate(checked.spans):
        request = read_line(content[start:end].decode(), number)
        try:
            json_input.check(request.body)
        except ExoError:
            continue
        assert type(request).model_validate_json(request.model_dump_json()) == request
