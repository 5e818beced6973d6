"""What a plugin author imports: the hook markers, and a health check's interface and record.

::

    from planaria.plugin import DeviceResult, HealthCheck, HealthCheckRecord, Status, hookimpl

Each name lives in its own module (``planaria.health.api``, ``planaria.plugin.records``,
``planaria.errors``); this module hands it out on first use, so that importing the markers (as
every built-in plugin does) loads no kind at all and cannot form an import cycle.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import pluggy

PROJECT_NAME = "planaria"
ENTRY_POINT_GROUP = "planaria"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

_HOME = {
    "planaria.plugin.records": ("HealthCheckRecord", "NoOptions"),
    "planaria.health.api": ("CheckContext", "CheckResult", "DeviceResult", "HealthCheck", "Status"),
    "planaria.errors": ("HealthCheckError",),
}
_MODULE_OF = {name: module for module, names in _HOME.items() for name in names}

__all__ = [
    "ENTRY_POINT_GROUP",
    "PROJECT_NAME",
    "CheckContext",
    "CheckResult",
    "DeviceResult",
    "HealthCheck",
    "HealthCheckError",
    "HealthCheckRecord",
    "NoOptions",
    "Status",
    "hookimpl",
    "hookspec",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'planaria.plugin' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
    from planaria.errors import HealthCheckError
    from planaria.health.api import CheckContext, CheckResult, DeviceResult, HealthCheck, Status
    from planaria.plugin.records import HealthCheckRecord, NoOptions
