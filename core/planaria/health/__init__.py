"""Health checks: the interface (``api``), the built-in host check and the isolating runner."""

from __future__ import annotations

from planaria.moved import forward

_MOVED = {
    "planaria.health.api": (
        "CheckContext",
        "CheckResult",
        "DeviceResult",
        "HealthCheck",
        "NodeHealth",
        "Status",
    ),
}


def __getattr__(name: str) -> object:
    """The names that lived here before ``planaria.health.api`` (deprecated)."""
    return forward(__name__, _MOVED, name)
