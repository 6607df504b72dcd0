"""Plain-text tables for the CLI's listings, with every time in one format."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """Aligned columns; None shows as '-'."""
    cells = [headers, *[["-" if v is None else str(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def listing(headers: list[str], rows: list[list[Any]], nothing: str) -> str:
    """The table, or with no rows the line `nothing` that says so (a bare header reads as if
    the listing had failed)."""
    return table(headers, rows) if rows else nothing


def timestamp(value: str | float) -> str:
    """A time in UTC, to the second, saying so (one column, pasteable): from an ISO 8601 string
    (a job's times) or seconds since the epoch (a batch's)."""
    if isinstance(value, str):
        moment = datetime.fromisoformat(value)
        moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment
    else:
        moment = datetime.fromtimestamp(value, UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
