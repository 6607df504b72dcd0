"""Structured logs: one logfmt line per event, naming the host, runner and job it concerns."""

from __future__ import annotations

import logging
import sys
from typing import Any

# Attributes every LogRecord has; anything else was passed with `extra=` and is printed.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _quote(value: Any) -> str:
    text = str(value)
    if not text or any(c in text for c in ' ="\n'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


class LogfmtFormatter(logging.Formatter):
    def __init__(self, context: dict[str, Any]) -> None:
        super().__init__()
        self.context = context

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **self.context,
        }
        fields.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        line = " ".join(f"{key}={_quote(value)}" for key, value in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure_logging(level: str = "INFO", **context: Any) -> None:
    """Send this process's logs to stderr as logfmt, with `context` (host, runner…) on each line."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter(context))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
