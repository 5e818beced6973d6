"""Durations in config files: ``30s``, ``5m``, ``1h30m``, ``500ms`` or a bare number of seconds."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_PART = re.compile(rf"({_NUMBER})\s*(ms|s|m|h|d)")
_WHOLE = re.compile(rf"^(?:\s*{_NUMBER}\s*(?:ms|s|m|h|d))+\s*$")
_CLOCK = re.compile(r"^\d+(?::\d+)+$")  # 1:30, which a config file reads as text
EXPECTED = "a number of seconds or a duration such as 500ms, 30s, 5m, 1h30m"


def parse_duration(value: Any) -> float:
    """``"1m30s"`` -> ``90.0``. Raises ``ValueError`` with what was expected."""
    if isinstance(value, bool):
        raise ValueError(f"expected {EXPECTED}, got a boolean")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        try:
            seconds = float(text)
        except ValueError:
            if _CLOCK.match(text):
                raise ValueError(
                    f"invalid duration {value!r}: minutes:seconds or hours:minutes? write it "
                    "with units, such as 1m30s or 1h30m"
                ) from None
            if not _WHOLE.match(text):
                raise ValueError(f"invalid duration {value!r}: expected {EXPECTED}") from None
            seconds = sum(float(n) * _UNITS[u] for n, u in _PART.findall(text))
    else:
        raise ValueError(f"expected {EXPECTED}, got {type(value).__name__}")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"invalid duration {value!r}: it must be positive and finite")
    return seconds


def _number(value: float) -> str:
    # Never an exponent ("1e+06"), which the parser rightly refuses.
    return f"{value:.6f}".rstrip("0").rstrip(".")


def format_duration(seconds: float) -> str:
    """``90.0`` -> ``"90s"``; ``0.5`` -> ``"500ms"``; ``3600`` -> ``"1h"``."""
    if seconds < 1:
        return f"{_number(seconds * 1000)}ms"
    for unit, size in (("h", 3600.0), ("m", 60.0)):
        if seconds % size == 0:
            return f"{_number(seconds / size)}{unit}"
    return f"{_number(seconds)}s"


Duration = Annotated[
    float,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "exclusiveMinimum": 0},
                {"type": "string", "pattern": _WHOLE.pattern},
            ],
            "description": f"seconds: {EXPECTED}",
        }
    ),
]
"""A positive duration in seconds, written as a number or with units."""
