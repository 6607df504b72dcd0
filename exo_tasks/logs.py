"""Structured logs: one logfmt line per event, naming the host, runner and job it concerns."""

from __future__ import annotations

import logging
import sys
from typing import Any

from billiard.exceptions import SoftTimeLimitExceeded

# Attributes every LogRecord has; anything else was passed with `extra=` and is printed.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _quote(value: Any) -> str:
    text = str(value)
    if not text or any(c in text for c in ' ="\n'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def _without_traceback(data: dict[str, Any]) -> dict[str, Any]:
    # Celery's task log lines carry their context as `data`, with the traceback in it even when
    # Celery's own policy prints none (a task ignored, at info: every cancel). A traceback
    # Celery means to show comes as the record's exc_info, printed below.
    return {key: value for key, value in data.items() if key != "traceback"}


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
        if isinstance(fields.get("data"), dict):
            fields["data"] = _without_traceback(fields["data"])
        line = " ".join(f"{key}={_quote(value)}" for key, value in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    def handleError(self, record: logging.LogRecord) -> None:
        # Celery's soft time limit is an exception raised by a signal handler: if it lands while
        # a line is written, logging would print it and go on, and the task would never see it.
        if isinstance(sys.exc_info()[1], SoftTimeLimitExceeded):
            raise
        super().handleError(record)


def configure_logging(level: str = "INFO", **context: Any) -> None:
    """Send this process's logs to stderr as logfmt, with `context` (host, runner…) on each line."""
    handler = _Handler(sys.stderr)
    handler.setFormatter(LogfmtFormatter(context))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
