"""Restoring a saved step into a training state: from shared memory, else from storage.

Which source serves is :meth:`Checkpointer.load
<planaria.checkpoint.checkpointer.Checkpointer.load>`'s call: memory when every rank holds the
same newest step (:func:`agreed_memory_step`, or the master's decision), else the newest
committed step that verifies on every rank (:func:`from_storage`). Either way the template's
tensors are filled in place where they fit (:func:`fill`). A committed step's shard files are
checked before the ranks agree on the step (:class:`StorageShards`: nothing may fail after
that), and a DTensor whose sharding changed since the save gets its new local shard assembled
from every saved shard that overlaps it (:func:`reshard`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from planaria.checkpoint.device import Device, device_for
from planaria.checkpoint.layout import TensorEntry, dtype_of, rebuild
from planaria.checkpoint.manifest import Manifest, ShardRecord
from planaria.checkpoint.persisted import PersistedCheckpoints
from planaria.checkpoint.segment import Segment
from planaria.errors import CheckpointCorruptError, CheckpointRestoreError
from planaria.log import get_logger

log = get_logger("checkpoint")


def agreed_memory_step(segment: Segment | None, rank: int, world: int) -> int | None:
    """The newest step this rank holds in ``segment``, if every rank holds that same step
    newest (they agree over ``torch.distributed``; without it, one rank of many cannot know)."""
    mine = -1
    if segment is not None:
        mine = max(
            (i.step for i in segment.valid() if i.rank == rank and i.world == world),
            default=-1,
        )
    if world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        bounds = torch.tensor([mine, -mine], dtype=torch.int64)
        torch.distributed.all_reduce(bounds, op=torch.distributed.ReduceOp.MAX)
        if int(bounds[0]) != mine or -int(bounds[1]) != mine:
            return None
    elif world > 1:
        return None  # no way to agree with the other ranks: storage is the safe choice
    return mine if mine >= 0 else None


def from_memory(
    segment: Segment,
    step: int,
    template: Any,
    *,
    rank: int,
    world: int,
    device: Device | None,
    mapped: bool,
) -> Any:
    """``step`` of ``segment`` as a state like ``template``. ``device`` copies every tensor
    when given (else each tensor's own device's); ``mapped``: this process wrote the segment,
    so its pages are mapped here already (else host tensors are read in one pass)."""
    with segment.reading(step) as info:
        if info.rank != rank or info.world != world:
            raise LookupError(
                f"memory holds rank {info.rank} of {info.world}, this is rank {rank} of {world}"
            )
        meta = segment.meta(info)
        entries = [TensorEntry.from_json(e) for e in meta["tensors"]]
        reads: list[tuple[torch.Tensor, int]] = []
        devices: dict[int, Device] = {}

        def tensor(index: int, old: Any) -> Any:
            entry = entries[index]
            target = in_place_target(old, entry)
            if target is not None and entry.nbytes and (device is not None or not target.is_cpu):
                # Into device memory: from the registered segment, on the side stream.
                copier = device or device_for(target.device)
                if id(copier) not in devices:
                    devices[id(copier)] = copier
                    segment.register_host(copier, background=False, slots=(info.slot,))
                    copier.start()
                raw = segment.tensor(info, entry.offset, entry.nbytes)
                copier.copy(target, raw.view(dtype_of(entry.dtype)).view(entry.shape))
                return old
            if (
                not mapped  # a restarted worker: nothing of the segment mapped here
                and target is not None
                and entry.nbytes
                and target.device.type == "cpu"
                and target.is_contiguous()
            ):
                reads.append((target, entry.offset))
                return old
            raw = segment.tensor(info, entry.offset, entry.nbytes)
            return fill(raw, entry, old)

        try:
            restored = rebuild(meta["tree"], tensor, template)
            segment.read_into(info, reads)
        finally:
            for copier in devices.values():  # one wait each, while the slot is held
                copier.finish().wait()
        return restored


def from_storage(
    store: PersistedCheckpoints,
    template: Any,
    *,
    rank: int,
    world: int,
    rejected: dict[int, str],
    report: Callable[..., None],
    require_restore: bool,
    where: str,
) -> tuple[int, Any] | None:
    """The newest committed step of ``store`` that verifies on every rank, as ``(step,
    state)``; None if there is none. Each step rejected goes into ``rejected`` (with why) and
    is reported (``report(event, **fields)``); when steps exist and none verifies, a start from
    scratch is reported (by rank 0), or refused when ``require_restore``."""
    distributed = (
        world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
    )
    committed = store.committed_steps()
    for step in committed:
        try:
            manifest = store.manifest(step)
            loader = StorageShards(store, step, manifest)
            saved_world = manifest.world
            primary = rank if rank < saved_world else 0
            if distributed:
                loader.verify([primary])
            else:  # every rank must reach the same verdict without talking: check all
                loader.verify(range(saved_world))
            ok = True
        except CheckpointCorruptError as exc:
            warnings.warn(f"skipping checkpoint step-{step}: {exc}", stacklevel=2)
            log.warning("skipping corrupt checkpoint", step=step, error=str(exc))
            rejected[step] = str(exc)
            report("checkpoint_skipped", step=step, rank=rank, error=str(exc))
            ok = False
        if distributed:
            flag = torch.tensor([1 if ok else 0])
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
            if ok and not int(flag[0]):
                log.warning("another rank rejected checkpoint; trying an older one", step=step)
                rejected[step] = "rejected by another rank"
            ok = bool(int(flag[0]))
        if not ok:
            continue
        return step, loader.rebuild(primary, template)
    if committed:  # there were steps, and none verified
        listed = ", ".join(map(str, committed))
        why = f"committed checkpoint steps {listed} in {where} all failed verification"
        if rank == 0:
            report("started_from_scratch", rank=rank, steps=committed, error=why)
        if require_restore:
            raise CheckpointRestoreError(
                f"nothing to restore: {why}, and restoring one is required "
                "(checkpoint.require_restore): repair or remove them, or allow a start "
                "from scratch"
            )
    return None


def in_place_target(old: Any, entry: TensorEntry) -> torch.Tensor | None:
    """The tensor to fill in place for ``entry``: ``old`` (or its local shard) if it fits."""
    if not isinstance(old, torch.Tensor):
        return None
    local = old.to_local() if hasattr(old, "to_local") and type(old).__name__ == "DTensor" else old
    if tuple(local.shape) == entry.shape and local.dtype == dtype_of(entry.dtype):
        return local
    return None


def fill(raw: torch.Tensor, entry: TensorEntry, old: Any) -> torch.Tensor:
    """``entry``'s bytes ``raw`` as its tensor: copied into ``old`` where it fits, else new."""
    src = raw.view(dtype_of(entry.dtype)).view(entry.shape) if entry.nbytes else None
    target = in_place_target(old, entry)
    if target is not None:
        if src is not None:
            target.copy_(src)
        return old if isinstance(old, torch.Tensor) else target
    if src is None:
        return torch.empty(entry.shape, dtype=dtype_of(entry.dtype))
    return src.clone()


class StorageShards:
    """One committed step's shards, read and verified on demand."""

    def __init__(self, store: PersistedCheckpoints, step: int, manifest: Manifest) -> None:
        self.store = store
        self.step = step
        self.manifest = manifest
        self._shards: dict[int, tuple[ShardRecord, bytes]] = {}

    def verify(self, ranks: Any) -> None:
        """Every file these ranks read matches the manifest, and their layout fits their data
        (before the ranks agree on the step: nothing may fail after that)."""
        for rank in ranks:
            _, data = self.shard(rank)
            for entry in self.entries(rank):
                if entry.offset + entry.nbytes > len(data):
                    raise CheckpointCorruptError(
                        f"step-{self.step}/rank-{rank}.bin: tensor {entry.path} lies beyond its end"
                    )

    def shard(self, rank: int) -> tuple[ShardRecord, bytes]:
        if rank not in self._shards:
            self._shards[rank] = self.store.shard(self.step, rank, self.manifest)
        return self._shards[rank]

    def entries(self, rank: int) -> list[TensorEntry]:
        record, _ = self.shard(rank)
        try:
            return [TensorEntry.from_json(e) for e in record.meta.tensors]
        except (ValueError, KeyError, TypeError) as exc:  # LayoutError is a TypeError
            raise CheckpointCorruptError(
                f"step-{self.step}/rank-{rank}.json: not a valid tensor layout ({exc})"
            ) from exc

    def raw(self, rank: int, entry: TensorEntry) -> torch.Tensor:
        _, data = self.shard(rank)
        if entry.offset + entry.nbytes > len(data):
            raise CheckpointCorruptError(
                f"step-{self.step}/rank-{rank}.bin: tensor {entry.path} lies beyond its end"
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only bytes: every use copies out of them
            if not entry.nbytes:
                return torch.empty(0, dtype=torch.uint8)
            return torch.frombuffer(
                data, dtype=torch.uint8, count=entry.nbytes, offset=entry.offset
            )

    def rebuild(self, primary: int, template: Any) -> Any:
        record, _ = self.shard(primary)
        entries = self.entries(primary)
        world = self.manifest.world

        def tensor(index: int, old: Any) -> Any:
            entry = entries[index]
            if entry.global_shape is not None and is_resharded(old, entry):
                return reshard(old, entry, self, world)
            return fill(self.raw(primary, entry), entry, old)

        return rebuild(record.meta.tree, tensor, template)


def is_resharded(old: Any, entry: TensorEntry) -> bool:
    if old is None or type(old).__name__ != "DTensor":
        return False
    from planaria.checkpoint.layout import local_offset

    gshape, goffset = local_offset(old)
    local = tuple(old.to_local().shape)
    return (gshape, goffset, local) != (entry.global_shape, entry.global_offset, entry.shape)


def reshard(old: Any, entry: TensorEntry, shards: StorageShards, world: int) -> Any:
    """Fill a DTensor's local shard from every saved shard that overlaps it."""
    from planaria.checkpoint.layout import local_offset

    gshape, goffset = local_offset(old)
    if tuple(gshape) != entry.global_shape:
        raise CheckpointCorruptError(
            f"{entry.path}: saved with global shape {list(entry.global_shape or ())}, the model "
            f"has {list(gshape)}"
        )
    target = old.to_local()
    want = [(o, o + n) for o, n in zip(goffset, target.shape, strict=True)]
    covered = 0
    for rank in range(world):
        for other in shards.entries(rank):
            if other.path != entry.path or other.global_offset is None:
                continue
            have = [(o, o + n) for o, n in zip(other.global_offset, other.shape, strict=True)]
            box = [
                (max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(want, have, strict=False)
            ]
            if any(lo >= hi for lo, hi in box):
                continue
            src = shards.raw(rank, other).view(dtype_of(other.dtype)).view(other.shape)
            src_index = tuple(
                slice(lo - h0, hi - h0) for (lo, hi), (h0, _) in zip(box, have, strict=False)
            )
            dst_index = tuple(
                slice(lo - w0, hi - w0) for (lo, hi), (w0, _) in zip(box, want, strict=False)
            )
            target[dst_index].copy_(src[src_index])
            volume = 1
            for lo, hi in box:
                volume *= hi - lo
            covered += volume
    if covered != target.numel():
        raise CheckpointCorruptError(
            f"{entry.path}: the saved shards cover {covered} of the {target.numel()} elements "
            "this rank needs"
        )
    return old
