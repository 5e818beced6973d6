"""Storage keys: the same rules as every planaria storage, plus the names this one reserves."""

from __future__ import annotations

from planaria import plugin
from planaria.errors import StorageError

RESERVED = ".planaria-"
"""Object names starting with this are the storage's own (commit markers, temporary uploads)."""

_WILDCARDS = "*?["


def split_key(key: str, *, allow_root: bool = False) -> list[str]:
    """The segments of a valid key (the rules of every planaria storage, then this one's
    own), or a :class:`StorageError` naming the key."""
    parts = plugin.split_key(key, allow_root=allow_root)
    if any(part.startswith(RESERVED) for part in parts):
        raise StorageError(
            f"storage key {key!r} has a segment starting with {RESERVED!r}, which the fsspec "
            "storage reserves for its commit markers and temporary objects"
        )
    if any(char in key for char in _WILDCARDS):
        raise StorageError(
            f"storage key {key!r} contains one of {_WILDCARDS!r}, which fsspec reads as wildcards"
        )
    return parts
