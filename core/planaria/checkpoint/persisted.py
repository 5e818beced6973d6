"""Persisted checkpoints on a storage target: the commit protocol and verified reads.

Layout under the storage root::

    step-120.partial/rank-0.bin    shards being written (never read)
    step-120.partial/rank-0.json   each shard's record: size, checksum, tensor layout
    step-100/                      a committed step: the shards, their records, then
    step-100/manifest.json         the manifest, written last, before the rename
    latest                         {"step": 100}: a pointer for tools; readers list steps
    fence                          {"generation": 4}: commits of older rounds are refused

A step is committed once every rank's shard is in ``step-N.partial/``: the manifest (each file's
size and xxh3-64 checksum) is written last, the directory is renamed to ``step-N/`` by the
storage's atomic commit, then ``latest`` is updated and steps beyond ``keep_last`` are deleted.
A reader takes only ``step-N/`` with a manifest, and checks the size and checksum of every file
it reads against it; anything that does not verify is skipped with a warning naming it. The
manifest and the shard records are validated as a whole (:class:`Manifest`, :class:`ShardRecord`):
a malformed one is a step that does not verify, whatever is wrong in it.

A rank whose shard cannot be written leaves ``step-N.partial/rank-R.failed`` (empty: it fits on
a full disk), so that the persister committing the step gives up at once instead of waiting.
Retention keeps the newest ``keep_last`` steps that verify (:meth:`PersistedCheckpoints.retain`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import time
from collections.abc import Iterable, Iterator
from typing import Any

import xxhash

# The records lived here first: their names stay importable from this module too.
from planaria.checkpoint.manifest import FORMAT as FORMAT
from planaria.checkpoint.manifest import HASH as HASH
from planaria.checkpoint.manifest import FileEntry as FileEntry
from planaria.checkpoint.manifest import Manifest as Manifest
from planaria.checkpoint.manifest import ShardMeta as ShardMeta
from planaria.checkpoint.manifest import ShardRecord as ShardRecord
from planaria.checkpoint.manifest import checksum as checksum
from planaria.checkpoint.manifest import parse_strict
from planaria.errors import CheckpointCorruptError, FencedError, StorageError
from planaria.log import get_logger
from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginKind
from planaria.storage.api import CheckpointStorage

log = get_logger("checkpoint")

MANIFEST = "manifest.json"
LATEST = "latest"
FENCE = "fence"
_STEP = re.compile(r"^step-(\d+)$")
_PARTIAL = re.compile(r"^step-(\d+)\.partial$")

AnyStorage = CheckpointStorage[Any]


def step_dir(step: int, *, partial: bool = False) -> str:
    return f"step-{step}.partial" if partial else f"step-{step}"


def shard_name(rank: int) -> str:
    return f"rank-{rank}.bin"


def record_name(rank: int) -> str:
    return f"rank-{rank}.json"


def failed_name(rank: int) -> str:
    return f"rank-{rank}.failed"


_FAILED = re.compile(r"^rank-(\d+)\.failed$")


def _chunks(view: memoryview, size: int = 64 << 20) -> Iterator[memoryview]:
    for start in range(0, len(view), size):
        yield view[start : start + size]


class PersistedCheckpoints:
    """Writes, commits, lists and verifies flash checkpoints on one storage target."""

    def __init__(self, storage: AnyStorage, keep_last: int = 3) -> None:
        self.storage = storage
        self.keep_last = keep_last
        self.rejected: set[int] = set()
        """Steps a verified read rejected (:meth:`reject`)."""

    @classmethod
    def open(cls, spec: dict[str, Any], keep_last: int = 3) -> PersistedCheckpoints:
        """On the storage ``spec`` selects (``{"backend": "local", "options": {"path": ...}}``,
        plus, when the master made it, the ``plugin`` that provides the backend and the job's
        ``disable`` list): only that plugin is imported."""
        disable = spec.get("disable", []) if isinstance(spec, dict) else []
        manager = PluginManager.for_spec(spec, disable=disable)
        storage = manager.build(PluginKind.CHECKPOINT_STORAGE, spec, path="checkpoint.storage")
        return cls(storage, keep_last)

    # -- writing (the persister) ---------------------------------------------------------------

    def write_shard(
        self,
        step: int,
        rank: int,
        world: int,
        data: memoryview,
        meta: dict[str, Any],
        generation: int = 0,
    ) -> ShardRecord:
        """Write one rank's shard and its record into ``step-N.partial/``, durably."""
        digest = xxhash.xxh3_64()

        def hashed() -> Iterator[memoryview]:
            for chunk in _chunks(data):
                digest.update(chunk)
                yield chunk

        layout = ShardMeta.model_validate(meta)
        partial = step_dir(step, partial=True)
        size = self.storage.write(f"{partial}/{shard_name(rank)}", hashed())
        record = ShardRecord(
            rank=rank,
            world=world,
            step=step,
            size=size,
            checksum=digest.hexdigest(),
            meta=layout,
            generation=generation,
        )
        self.storage.write(f"{partial}/{record_name(rank)}", [record.to_json()])
        return record

    def fail_shard(self, step: int, rank: int) -> None:
        """This rank's shard of ``step`` will not come (its write failed): free what was written
        of it and leave the marker that ends the step's commit. Best effort: the storage may be
        failing too."""
        partial = step_dir(step, partial=True)
        for name in (record_name(rank), shard_name(rank)):
            with contextlib.suppress(StorageError, OSError):
                self.storage.delete(f"{partial}/{name}")
        with contextlib.suppress(StorageError, OSError):
            self.storage.write(f"{partial}/{failed_name(rank)}", [])

    def commit_progress(self, step: int, world: int) -> tuple[set[int], set[int]]:
        """(the ranks whose record of ``step`` is in, the ranks that gave up on it)."""
        names = set(self.storage.list(step_dir(step, partial=True)))
        failed = {int(m.group(1)) for n in names if (m := _FAILED.match(n))}
        return {r for r in range(world) if record_name(r) in names}, failed

    def abandon(self, step: int) -> None:
        """Remove ``step-N.partial/``: the step will never be committed."""
        self.storage.delete(step_dir(step, partial=True))

    # -- fencing ---------------------------------------------------------------------------

    def fence(self, generation: int) -> None:
        """From now on, refuse commits of rounds older than ``generation``: the master calls
        this before a round without a node it declared lost starts, so that the lost node's
        workers, still running somewhere cut off, cannot commit what they save."""
        if generation > self.fenced_at():
            self.storage.write(FENCE, [json.dumps({"generation": generation}).encode()])

    def fenced_at(self) -> int:
        """The oldest round whose commits are still taken (0: no fence)."""
        try:
            raw = self.storage.read(FENCE)
        except (StorageError, FileNotFoundError):
            return 0
        try:
            value = json.loads(raw)["generation"]
        except (ValueError, KeyError, TypeError):
            value = None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointCorruptError(f"{FENCE}: not a fence record: {raw[:80]!r}")
        return value

    def commit(self, step: int, world: int, generation: int = 0) -> Manifest:
        """Write the manifest of a complete ``step-N.partial/``, rename it to ``step-N/``,
        point ``latest`` at it and apply retention. Returns the manifest. Every shard must be
        of ``generation``, and the storage must not be fenced past it."""
        partial = step_dir(step, partial=True)
        files: dict[str, FileEntry] = {}
        for rank in range(world):
            raw = self.storage.read(f"{partial}/{record_name(rank)}")
            record = ShardRecord.parse(raw, f"{partial}/{record_name(rank)}")
            if record.step != step or record.world != world or record.rank != rank:
                raise CheckpointCorruptError(
                    f"{partial}/{record_name(rank)} describes rank {record.rank} of "
                    f"{record.world} at step {record.step}, not rank {rank} of {world} at {step}"
                )
            if record.generation != generation:
                raise FencedError(
                    f"{partial}/{record_name(rank)} was saved in round {record.generation}, "
                    f"not in round {generation} that commits the step: a fenced node wrote it"
                )
            files[shard_name(rank)] = FileEntry(size=record.size, checksum=record.checksum)
            size, digest = checksum([raw])
            files[record_name(rank)] = FileEntry(size=size, checksum=digest)
        if step in self.committed_steps() and not self.usable(step):
            # A step of this number that does not verify (an earlier run's, corrupt): the new,
            # good one takes its place.
            log.warning("replacing a committed step that does not verify", step=step)
            self.storage.delete(step_dir(step))
        self.rejected.discard(step)
        manifest = Manifest(
            format=FORMAT,
            step=step,
            world=world,
            hash=HASH,
            created=time.time(),
            files=files,
            generation=generation,
        )
        self.storage.write(f"{partial}/{MANIFEST}", [manifest.model_dump_json(indent=1).encode()])
        fence = self.fenced_at()
        if generation < fence:  # as late as can be: the rename is the commit
            raise FencedError(
                f"step {step} of round {generation} not committed: the master fenced rounds "
                f"before {fence} out (this node was declared lost)"
            )
        self.storage.commit(partial, step_dir(step))
        self.storage.write(LATEST, [json.dumps({"step": step}).encode()])
        self.retain()
        return manifest

    def retain(self) -> list[str]:
        """Keep the newest ``keep_last`` steps that verify; delete every step older than the
        oldest of them and every partial step not newer than the newest. Returns what was
        deleted.

        A step that does not verify never counts as kept, so it cannot push a good step out.
        One newer than the kept ones stays (readers skip it; it is the evidence of what went
        wrong, and the verdict may come from a read error rather than from its bytes) until it
        is older than every kept step, or until a new commit of its step number replaces it.
        """
        committed = self.committed_steps()
        # Newest first, and no further than needed: each check reads a manifest.
        kept = list(itertools.islice((s for s in committed if self.usable(s)), self.keep_last))
        if not kept:
            return []
        doomed = [step_dir(s) for s in committed if s < kept[-1]]
        for name in self.storage.list(""):
            match = _PARTIAL.match(name)
            if match and int(match.group(1)) <= kept[0]:
                doomed.append(name)
        for key in doomed:
            self.storage.delete(key)
        return doomed

    def reject(self, steps: Iterable[int]) -> None:
        """Steps that a verified read rejected (a restore skipped them): they never count as
        kept, and a new commit of the same step replaces them."""
        self.rejected.update(steps)

    def usable(self, step: int) -> bool:
        """Whether ``step`` is committed with a valid manifest and no reader rejected it (the
        shards themselves are checked only when read)."""
        if step in self.rejected:
            return False
        try:
            self.manifest(step)
        except CheckpointCorruptError:
            return False
        return True

    # -- reading -------------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """Steps that have a ``step-N/`` directory, newest first (not yet verified)."""
        steps = []
        for name in self.storage.list(""):
            match = _STEP.match(name)
            if match:
                steps.append(int(match.group(1)))
        return sorted(steps, reverse=True)

    def manifest(self, step: int) -> Manifest:
        key = f"{step_dir(step)}/{MANIFEST}"
        try:
            raw = self.storage.read(key)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{key}: missing (the step was never committed)") from None
        except (StorageError, OSError) as exc:
            raise CheckpointCorruptError(f"{key}: cannot be read ({exc})") from exc
        manifest = parse_strict(Manifest, raw, key, "manifest")
        if manifest.step != step:
            raise CheckpointCorruptError(
                f"{key}: not a valid manifest (it describes step {manifest.step})"
            )
        return manifest

    def read_verified(self, step: int, name: str, manifest: Manifest) -> bytes:
        """A whole file of a committed step, checked against the manifest."""
        key = f"{step_dir(step)}/{name}"
        expected = manifest.files.get(name)
        if expected is None:
            raise CheckpointCorruptError(f"{key}: not listed in the manifest")
        try:
            raw = self.storage.read(key)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{key}: listed in the manifest but missing") from None
        except (StorageError, OSError) as exc:
            raise CheckpointCorruptError(f"{key}: cannot be read ({exc})") from exc
        if len(raw) != expected.size:
            raise CheckpointCorruptError(
                f"{key}: {len(raw)} bytes, the manifest says {expected.size}"
            )
        _, digest = checksum([raw])
        if digest != expected.checksum:
            raise CheckpointCorruptError(
                f"{key}: checksum {digest} does not match the manifest's {expected.checksum}"
            )
        return raw

    def shard(self, step: int, rank: int, manifest: Manifest) -> tuple[ShardRecord, bytes]:
        """One rank's verified record and data."""
        where = f"{step_dir(step)}/{record_name(rank)}"
        record = ShardRecord.parse(self.read_verified(step, record_name(rank), manifest), where)
        if (record.rank, record.world, record.step) != (rank, manifest.world, step):
            raise CheckpointCorruptError(
                f"{where}: describes rank {record.rank} of {record.world} at step {record.step}, "
                f"the manifest rank {rank} of {manifest.world} at step {step}"
            )
        listed = manifest.files.get(shard_name(rank))
        if listed is None or (listed.size, listed.checksum) != (record.size, record.checksum):
            raise CheckpointCorruptError(
                f"{where}: its shard's size and checksum differ from the manifest's"
            )
        data = self.read_verified(step, shard_name(rank), manifest)
        return record, data
