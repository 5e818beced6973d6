"""Persisted checkpoints on a storage target: the commit protocol and verified reads.

Layout under the storage root::

    step-120.partial/rank-0.bin    shards being written (never read)
    step-120.partial/rank-0.json   each shard's record: size, checksum, tensor layout
    step-100/                      a committed step: the shards, their records, then
    step-100/manifest.json         the manifest, written last, before the rename
    latest                         {"step": 100}: a pointer for tools; readers list steps

A step is committed once every rank's shard is in ``step-N.partial/``: the manifest (each file's
size and xxh3-64 checksum) is written last, the directory is renamed to ``step-N/`` by the
storage's atomic commit, then ``latest`` is updated and steps beyond ``keep_last`` are deleted.
A reader takes only ``step-N/`` with a manifest, and checks the size and checksum of every file
it reads against it; anything that does not verify is skipped with a warning naming it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import xxhash

from planaria.errors import CheckpointCorruptError, StorageError
from planaria.log import get_logger
from planaria.storage import CheckpointStorage

log = get_logger("checkpoint")

FORMAT = "planaria-flash/1"
HASH = "xxh3_64"
MANIFEST = "manifest.json"
LATEST = "latest"
_STEP = re.compile(r"^step-(\d+)$")
_PARTIAL = re.compile(r"^step-(\d+)\.partial$")

AnyStorage = CheckpointStorage[Any]


def step_dir(step: int, *, partial: bool = False) -> str:
    return f"step-{step}.partial" if partial else f"step-{step}"


def shard_name(rank: int) -> str:
    return f"rank-{rank}.bin"


def record_name(rank: int) -> str:
    return f"rank-{rank}.json"


def checksum(chunks: Iterable[bytes | memoryview]) -> tuple[int, str]:
    digest = xxhash.xxh3_64()
    size = 0
    for chunk in chunks:
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


@dataclass(frozen=True)
class ShardRecord:
    """What the persister writes beside a shard, and what the manifest lists."""

    rank: int
    world: int
    step: int
    size: int
    checksum: str
    meta: dict[str, Any]

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT,
                "rank": self.rank,
                "world": self.world,
                "step": self.step,
                "size": self.size,
                "hash": HASH,
                "checksum": self.checksum,
                "meta": self.meta,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def parse(cls, raw: bytes, where: str) -> ShardRecord:
        try:
            obj = json.loads(raw)
            if obj.get("format") != FORMAT or obj.get("hash") != HASH:
                raise ValueError(f"format {obj.get('format')!r}, hash {obj.get('hash')!r}")
            return cls(
                rank=int(obj["rank"]),
                world=int(obj["world"]),
                step=int(obj["step"]),
                size=int(obj["size"]),
                checksum=str(obj["checksum"]),
                meta=dict(obj["meta"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointCorruptError(f"{where}: not a valid shard record ({exc})") from exc


def _chunks(view: memoryview, size: int = 64 << 20) -> Iterator[memoryview]:
    for start in range(0, len(view), size):
        yield view[start : start + size]


class CheckpointStore:
    """Writes, commits, lists and verifies flash checkpoints on one storage target."""

    def __init__(self, storage: AnyStorage, keep_last: int = 3) -> None:
        self.storage = storage
        self.keep_last = keep_last

    # -- writing (the persister) ---------------------------------------------------------------

    def write_shard(
        self, step: int, rank: int, world: int, data: memoryview, meta: dict[str, Any]
    ) -> ShardRecord:
        """Write one rank's shard and its record into ``step-N.partial/``, durably."""
        digest = xxhash.xxh3_64()

        def hashed() -> Iterator[memoryview]:
            for chunk in _chunks(data):
                digest.update(chunk)
                yield chunk

        partial = step_dir(step, partial=True)
        size = self.storage.write(f"{partial}/{shard_name(rank)}", hashed())
        record = ShardRecord(rank, world, step, size, digest.hexdigest(), meta)
        self.storage.write(f"{partial}/{record_name(rank)}", [record.to_json()])
        return record

    def ready_to_commit(self, step: int, world: int) -> bool:
        names = set(self.storage.list(step_dir(step, partial=True)))
        return all(record_name(rank) in names for rank in range(world))

    def commit(self, step: int, world: int) -> dict[str, Any]:
        """Write the manifest of a complete ``step-N.partial/``, rename it to ``step-N/``,
        point ``latest`` at it and apply retention. Returns the manifest."""
        partial = step_dir(step, partial=True)
        files: dict[str, dict[str, Any]] = {}
        for rank in range(world):
            raw = self.storage.read(f"{partial}/{record_name(rank)}")
            record = ShardRecord.parse(raw, f"{partial}/{record_name(rank)}")
            if record.step != step or record.world != world or record.rank != rank:
                raise CheckpointCorruptError(
                    f"{partial}/{record_name(rank)} describes rank {record.rank} of "
                    f"{record.world} at step {record.step}, not rank {rank} of {world} at {step}"
                )
            files[shard_name(rank)] = {"size": record.size, "checksum": record.checksum}
            size, digest = checksum([raw])
            files[record_name(rank)] = {"size": size, "checksum": digest}
        manifest = {
            "format": FORMAT,
            "step": step,
            "world": world,
            "hash": HASH,
            "created": time.time(),
            "files": files,
        }
        self.storage.write(f"{partial}/{MANIFEST}", [json.dumps(manifest, indent=1).encode()])
        self.storage.commit(partial, step_dir(step))
        self.storage.write(LATEST, [json.dumps({"step": step}).encode()])
        self.retain()
        return manifest

    def retain(self) -> list[str]:
        """Delete committed steps beyond ``keep_last`` and partial steps older than the newest
        committed one. Returns what was deleted."""
        committed = self.committed_steps()
        doomed = [step_dir(s) for s in committed[self.keep_last :]]
        if committed:
            newest = committed[0]
            for name in self.storage.list(""):
                match = _PARTIAL.match(name)
                if match and int(match.group(1)) <= newest:
                    doomed.append(name)
        for key in doomed:
            self.storage.delete(key)
        return doomed

    # -- reading -------------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """Steps that have a ``step-N/`` directory, newest first (not yet verified)."""
        steps = []
        for name in self.storage.list(""):
            match = _STEP.match(name)
            if match:
                steps.append(int(match.group(1)))
        return sorted(steps, reverse=True)

    def manifest(self, step: int) -> dict[str, Any]:
        key = f"{step_dir(step)}/{MANIFEST}"
        try:
            raw = self.storage.read(key)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{key}: missing (the step was never committed)") from None
        try:
            manifest: dict[str, Any] = json.loads(raw)
            if manifest.get("format") != FORMAT or manifest.get("hash") != HASH:
                raise ValueError(f"format {manifest.get('format')!r}")
            if int(manifest["step"]) != step or not isinstance(manifest["files"], dict):
                raise ValueError(f"it describes step {manifest.get('step')}")
            int(manifest["world"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointCorruptError(f"{key}: not a valid manifest ({exc})") from exc
        return manifest

    def read_verified(self, step: int, name: str, manifest: dict[str, Any]) -> bytes:
        """A whole file of a committed step, checked against the manifest."""
        key = f"{step_dir(step)}/{name}"
        expected = manifest["files"].get(name)
        if expected is None:
            raise CheckpointCorruptError(f"{key}: not listed in the manifest")
        try:
            raw = self.storage.read(key)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{key}: listed in the manifest but missing") from None
        except StorageError as exc:
            raise CheckpointCorruptError(f"{key}: cannot be read ({exc})") from exc
        if len(raw) != expected["size"]:
            raise CheckpointCorruptError(
                f"{key}: {len(raw)} bytes, the manifest says {expected['size']}"
            )
        _, digest = checksum([raw])
        if digest != expected["checksum"]:
            raise CheckpointCorruptError(
                f"{key}: checksum {digest} does not match the manifest's {expected['checksum']}"
            )
        return raw

    def shard(self, step: int, rank: int, manifest: dict[str, Any]) -> tuple[ShardRecord, bytes]:
        """One rank's verified record and data."""
        where = f"{step_dir(step)}/{record_name(rank)}"
        record = ShardRecord.parse(self.read_verified(step, record_name(rank), manifest), where)
        data = self.read_verified(step, shard_name(rank), manifest)
        return record, data
