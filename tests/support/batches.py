"""Batches for tests: input files, and the waits and reads of OpenAI's Batch API."""

from __future__ import annotations

import json
from typing import Any, Final

import openai
from openai.types import Batch

from tests.support.processes import wait_until

CHAT_URL: Final = "/v1/chat/completions"


def chat_line(custom_id: str, content: str, **body: Any) -> dict[str, Any]:
    """A greedy chat request as a batch line."""
    request = {"model": "tiny", "messages": [{"role": "user", "content": content}], **body}
    request.setdefault("max_tokens", 8)
    request.setdefault("temperature", 0)
    return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL, "body": request}


def jsonl(lines: list[Any]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def start(
    client: openai.OpenAI, lines: list[Any], endpoint: str = CHAT_URL, window: str = "24h"
) -> Batch:
    uploaded = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window=window,  # type: ignore[arg-type]
    )


def wait_status(
    client: openai.OpenAI, batch_id: str, statuses: set[str], timeout_s: float
) -> Batch:
    def reached() -> Batch | None:
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in statuses else None

    found: Batch = wait_until(reached, timeout_s, f"batch {batch_id} {statuses}", interval_s=0.2)
    return found


def read_file(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
