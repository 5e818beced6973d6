"""The checkpoint storage interface: where persisted checkpoints live.

Keys are ``/``-separated relative paths (``step-100/rank-0.bin``). A step is committed by
:meth:`CheckpointStorage.commit`, which must be atomic: readers see the whole step or nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar, Generic, TypeVar

from pydantic import BaseModel

from planaria.errors import StorageError
from planaria.plugin.records import PluginKind, PluginRecord

OptionsT = TypeVar("OptionsT", bound=BaseModel)


def split_key(key: str, *, allow_root: bool = False) -> list[str]:
    """The segments of a valid key (``allow_root``: ``""`` is the root), or a
    :class:`~planaria.errors.StorageError` naming the key. Every storage applies these rules."""
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
    return parts


class CheckpointStorage(ABC, Generic[OptionsT]):
    """Base class of every storage target (``local``, ``fsspec`` ...)."""

    name: ClassVar[str] = ""

    def __init__(self, options: OptionsT) -> None:
        self.options = options

    @abstractmethod
    def write(self, key: str, chunks: Iterable[bytes | memoryview]) -> int:
        """Write an object from ``chunks`` and make it durable (fsync or the store's
        equivalent) before returning the number of bytes written."""

    @abstractmethod
    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Read an object, or a range of it. Raises ``FileNotFoundError`` if absent."""

    @abstractmethod
    def size(self, key: str) -> int:
        """Size in bytes of an object. Raises ``FileNotFoundError`` if absent."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys directly under ``prefix`` (one level, like ``ls``), sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete an object or a whole prefix; absent keys are not an error."""

    @abstractmethod
    def commit(self, partial: str, final: str) -> None:
        """Atomically make everything under ``partial`` visible as ``final``."""


class CheckpointStorageRecord(PluginRecord):
    kind: ClassVar[PluginKind] = PluginKind.CHECKPOINT_STORAGE
    well_known: ClassVar[dict[str, str]] = {"fsspec": "planaria-fsspec"}
    factory: type[CheckpointStorage]  # type: ignore[type-arg]  # pydantic rejects type[X[Any]]
