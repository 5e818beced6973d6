"""Storage keys: the same rules as every planaria storage, plus the names this one reserves."""

from __future__ import annotations

from planaria.errors import StorageError

RESERVED = ".planaria-"
"""Object names starting with this are the storage's own (commit markers, temporary uploads)."""

_WILDCARDS = "*?["


def split_key(key: str, *, allow_root: bool = False) -> list[str]:
    """The segments of a valid key, or a :class:`StorageError` naming the key."""
    if not isinstance(key, str):
        raise StorageError(f"storage key {key!r} must be a string")
    if key == "" and allow_root:
        return []
    if "\x00" in key:
        raise StorageError(f"storage key {key!r} contains a NUL character")
    if key.startswith("/"):
        raise StorageError(f"storage key {key!r} is absolute: it escapes the storage root")
    parts = key.split("/")
    if any(part in ("..", ".") for part in parts):
        raise StorageError(f"storage key {key!r} contains '.' or '..': it escapes the storage root")
    if any(part == "" for part in parts):
        raise StorageError(f"storage key {key!r} has an empty path segment")
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
