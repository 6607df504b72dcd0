"""Clients of the session stack's API besides `Api`'s own: the official OpenAI client."""

from __future__ import annotations

from typing import Any

import openai
from openai.types.chat import ChatCompletionMessageParam

from tests.support.api import Api

HOST_A = {"host": "host-a"}  # the session host: kept off any test's own worker
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


def client_for(api: Api) -> openai.OpenAI:
    # No retries: a test must see the first answer, and a retried 500 would submit again.
    return openai.OpenAI(base_url=api.url + "/v1", api_key="unused", max_retries=0)


def job_of(api: Api, openai_id: str) -> dict[str, Any]:
    """The exo job behind an OpenAI completion id (`chatcmpl-<job>` or `cmpl-<job>`)."""
    job: dict[str, Any] = api.get(f"/v1/jobs/{openai_id.split('-', 1)[1]}").json()
    return job
