"""Structured logging, configured once per process.

Every entry carries the ``component`` that wrote it and, where known, the ``job``, ``node``,
``rank`` and ``step`` (bound with :func:`bind`). Output goes to stderr so that a command's
stdout stays machine-readable (``planaria plugins --json``).
"""

from __future__ import annotations

import datetime
import logging
import sys
import time
from typing import Any, Literal, TextIO

import structlog

Format = Literal["console", "json"]
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure(
    format: Format = "console", level: str = "info", stream: TextIO | None = None
) -> None:
    """(Re)configure structlog for this process; later calls replace earlier ones."""
    renderer: Any
    stamper: Any
    if format == "json":
        renderer = structlog.processors.JSONRenderer(sort_keys=True)
        stamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=(stream or sys.stderr).isatty())
        stamper = _console_timestamp
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            stamper,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level.lower()]),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )


def timestamp(when: float | None = None) -> str:
    """The console's one time format, ``2026-12-01T21:16:12.484Z``: log entries and job events
    alike. UTC, so that lines from nodes in other time zones (and the JSON logs, which carry
    the same instant in microseconds) line up; milliseconds, which is what a person reads."""
    utc = datetime.timezone.utc
    moment = datetime.datetime.fromtimestamp(time.time() if when is None else when, utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _console_timestamp(logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    event_dict["timestamp"] = timestamp()
    return event_dict


def get_logger(component: str) -> Any:
    """A logger whose every entry names ``component``."""
    return structlog.get_logger(component=component)


def bind(**context: Any) -> None:
    """Attach ``job``/``node``/``rank``/``step`` (or anything) to every later entry."""
    structlog.contextvars.bind_contextvars(**context)
