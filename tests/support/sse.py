"""The one reader of server-sent events the tests and benchmarks use, for a whole body or an open
stream: exo_tasks' events (`event:` and `data:`) and OpenAI's chunks (`data:` alone); and a job's
stream timed token by token."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from typing import Any

import requests


def events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """Events as they arrive, each `{"id", "event", "data"}` with its data parsed from JSON;
    comments (keepalives) and blocks without an `event:` (OpenAI's `data:` chunks) skipped."""
    fields: dict[str, str] = {}
    for line in lines:
        if line:
            name, _, value = line.partition(": ")
            fields[name] = value
        elif "event" in fields:
            yield {
                "id": fields.get("id"),
                "event": fields["event"],
                "data": json.loads(fields["data"]),
            }
            fields = {}
        else:
            fields = {}
    if "event" in fields:  # a body cut right after its last line
        yield {"id": fields.get("id"), "event": fields["event"], "data": json.loads(fields["data"])}


def chunks(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """An OpenAI stream's chunks as they arrive, each parsed from JSON, up to `data: [DONE]`."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return
        yield json.loads(data)


def parse(text: str) -> list[dict[str, Any]]:
    """Every event of a whole SSE body."""
    return list(events(text.splitlines()))


def read(response: requests.Response) -> Iterator[dict[str, Any]]:
    """The events of an open SSE response, as they arrive."""
    return events(response.iter_lines(decode_unicode=True))


def time_tokens(url: str, job_id: str, arrivals: list[float]) -> None:
    """Read a job's stream from the API at `url` up to its first event that is no token,
    appending when each token arrived (time.monotonic()) to `arrivals`: a bystander's stream,
    timed by a thread of its own."""
    with requests.get(f"{url}/v1/jobs/{job_id}/stream", stream=True) as response:
        for event in read(response):
            if event["event"] != "token":
                return
            arrivals.append(time.monotonic())
