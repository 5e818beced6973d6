"""Schedulers: the interface (``api``) and the built-in local scheduler."""

from __future__ import annotations

from planaria.moved import forward

_MOVED = {
    "planaria.scheduler.api": (
        "LaunchSpec",
        "NodeEvent",
        "NodeHandle",
        "NodeState",
        "Scheduler",
    ),
}


def __getattr__(name: str) -> object:
    """The names that lived here before ``planaria.scheduler.api`` (deprecated)."""
    return forward(__name__, _MOVED, name)
