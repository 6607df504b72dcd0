"""The table /openapi.json is generated from: a route's replies, body and errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

JSON = "application/json"


@dataclass(frozen=True)
class Reply:
    """A response: a model (or a list of them), or text of a media type."""

    model: type[BaseModel] | None = None
    many: bool = False
    media: str = JSON
    description: str = "OK"
    or_events: bool = False  # or, when asked to stream, server-sent events


@dataclass(frozen=True)
class Op:
    method: str
    path: str
    summary: str
    replies: dict[int, Reply]
    body: type[BaseModel] | None = None
    body_required: bool = True
    errors: tuple[int, ...] = ()
    query: dict[str, dict[str, Any]] = field(default_factory=dict)
    openai: bool = False  # errors in OpenAI's shape
    public: bool = False  # open without the API token
    body_media: str = JSON
