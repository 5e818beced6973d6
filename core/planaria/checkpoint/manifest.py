"""A persisted step's records: what vouches for its files on storage.

Each shard has a record beside it (:class:`ShardRecord`: size, checksum, tensor layout) and a
committed step a manifest (:class:`Manifest`), written last, listing every file with its size
and xxh3-64 checksum (:func:`checksum`). Both are validated whole and strictly
(:func:`parse_strict`): a flipped byte that turns a number into a string, a key that appears
twice, a field too many, all make a step that does not verify, never one coerced into meaning
something. Where these files lie and how a step is committed is
:mod:`planaria.checkpoint.persisted`'s.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Literal, TypeVar

import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planaria.errors import CheckpointCorruptError

FORMAT: Literal["planaria-flash/1"] = "planaria-flash/1"
HASH: Literal["xxh3_64"] = "xxh3_64"


def checksum(chunks: Iterable[bytes | memoryview]) -> tuple[int, str]:
    digest = xxhash.xxh3_64()
    size = 0
    for chunk in chunks:
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


class _Strict(BaseModel):
    # Strict: a flipped byte that turns a number into a string or a float is corruption, not
    # something to coerce.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class FileEntry(_Strict):
    """One file of a committed step, as the manifest lists it."""

    size: int = Field(ge=0)
    checksum: str = Field(pattern=r"^[0-9a-f]{16}$")


class Manifest(_Strict):
    """A committed step's ``manifest.json``: written last, it vouches for every file."""

    format: Literal["planaria-flash/1"]
    step: int = Field(ge=0)
    world: int = Field(ge=1)
    hash: Literal["xxh3_64"]
    created: float
    files: dict[str, FileEntry]
    generation: int = Field(default=0, ge=0)
    """The round whose workers saved it (see
    :meth:`~planaria.checkpoint.persisted.PersistedCheckpoints.fence`)."""


class ShardMeta(BaseModel):
    """A shard's layout: its tensors in the flat buffer and the state's tree (see
    :mod:`planaria.checkpoint.layout`)."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)

    tensors: list[dict[str, Any]]
    tree: Any
    step: int


class ShardRecord(_Strict):
    """What the persister writes beside a shard, and what the manifest lists."""

    format: Literal["planaria-flash/1"] = FORMAT
    rank: int = Field(ge=0)
    world: int = Field(ge=1)
    step: int = Field(ge=0)
    size: int = Field(ge=0)
    hash: Literal["xxh3_64"] = HASH
    checksum: str = Field(pattern=r"^[0-9a-f]{16}$")
    meta: ShardMeta
    generation: int = Field(default=0, ge=0)

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def parse(cls, raw: bytes, where: str) -> ShardRecord:
        return parse_strict(cls, raw, where, "shard record")


_Model = TypeVar("_Model", bound=BaseModel)


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a key appears twice in {sorted(keys)}")
    return dict(pairs)


def parse_strict(model: type[_Model], raw: bytes, where: str, what: str) -> _Model:
    """``raw`` as ``model``, or :class:`CheckpointCorruptError` saying what is wrong in it."""
    try:
        return model.model_validate(json.loads(raw, object_pairs_hook=_unique), strict=True)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<top>'}: {e['msg']}"
            for e in exc.errors(include_url=False)[:3]
        )
        raise CheckpointCorruptError(f"{where}: not a valid {what} ({problems})") from None
    except (ValueError, TypeError, RecursionError) as exc:  # not JSON, not UTF-8, duplicates
        raise CheckpointCorruptError(f"{where}: not a valid {what} ({exc})") from None
