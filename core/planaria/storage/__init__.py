"""Checkpoint storage targets: the interface (``api``) and the built-in local filesystem."""

from __future__ import annotations

from planaria.moved import forward

_MOVED = {
    "planaria.storage.api": (
        "CheckpointStorage",
        "split_key",
    ),
}


def __getattr__(name: str) -> object:
    """The names that lived here before ``planaria.storage.api`` (deprecated)."""
    return forward(__name__, _MOVED, name)
