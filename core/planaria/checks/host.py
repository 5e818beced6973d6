"""The old home of the built-in host check, now :mod:`planaria.health.host`."""

from __future__ import annotations

from planaria.moved import forward

_MOVED = {"planaria.health.host": ("HostCheck", "HostOptions", "available_memory_bytes")}


def __getattr__(name: str) -> object:
    return forward(__name__, _MOVED, name)
