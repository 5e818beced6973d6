"""What planaria knows of one plugin: where it came from, whether it loaded (and why not),
and what it provides; ``planaria plugins`` shows it. Also the plugins a user blocked through
the environment (``PLANARIA_DISABLE_PLUGINS``)."""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pydantic import ValidationError

from planaria.fault_pattern.api import FaultPattern
from planaria.plugin.records import PluginKind, PluginRecord

DISABLE_ENV = "PLANARIA_DISABLE_PLUGINS"


class PluginStatus(str, Enum):
    LOADED = "loaded"
    BLOCKED = "blocked"
    FAILED = "failed"


@dataclass
class PluginInfo:
    """What ``planaria plugins`` shows for one plugin."""

    name: str
    value: str
    distribution: str | None = None
    version: str | None = None
    status: PluginStatus = PluginStatus.LOADED
    reason: str = ""
    records: list[PluginRecord] = field(default_factory=list)
    fault_patterns: list[FaultPattern] = field(default_factory=list)

    @property
    def kinds(self) -> list[str]:
        kinds = {r.kind.value for r in self.records}
        if self.fault_patterns:
            kinds.add(PluginKind.FAULT_PATTERN.value)
        return sorted(kinds)

    @property
    def provider(self) -> str:
        if self.distribution is None:
            return f"plugin {self.name!r}"
        return f"{self.distribution} {self.version or ''}".strip()

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kinds": self.kinds,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status.value,
            "reason": self.reason or None,
            "records": [r.describe() for r in self.records],
            "fault_patterns": [p.model_dump() for p in self.fault_patterns],
        }


def disabled_from_env() -> list[str]:
    return [n for n in os.environ.get(DISABLE_ENV, "").replace(",", " ").split() if n]


def one_line(exc: BaseException) -> str:
    """An exception as one line: reasons appear in tables, JSON and log entries."""
    if isinstance(exc, ValidationError):
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or exc.title}: {e['msg']}"
            for e in exc.errors(include_url=False)
        )
        return f"{exc.title} is invalid: {problems}"
    text = "".join(traceback.format_exception_only(type(exc), exc))
    return " ".join(text.split())
