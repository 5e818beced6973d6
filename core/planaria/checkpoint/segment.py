"""A rank's shared-memory segment: three slots, each holding one saved step.

File layout (a file in /dev/shm, mode 0600)::

    page 0            header: magic, version, slot capacity, then one descriptor per slot
    page 1 ...        slot 0: tensor data (aligned), then the JSON metadata
    ...               slots 1 and 2: the same

Why three slots: a save never overwrites the newest complete step, so a worker killed at any
moment of a save still leaves the newest step it completed whole in memory; and a save never
waits for the persister, which reads a slot under a shared lock. With two slots, a pinned slot
that does not hold the newest step would leave the newest one as the only slot to write: a kill
during that save would leave only the older, pinned step. The third slot is what a save writes
while the persister holds one and the newest step sits in another. The cost is three times the
state's size in shared memory; waiting instead would put the persister's read time (hundreds of
ms per GiB) into training's critical path.

Locks are POSIX record locks on each slot's descriptor (``fcntl.lockf``): a writer holds an
exclusive lock while it copies, a reader a shared one. The kernel drops them when a process
dies, so a crashed writer or reader never wedges the other. A slot's descriptor is set to
``WRITING`` before its data changes and to ``VALID`` only after data and metadata are complete.

Why one module: :class:`Segment` is one mapping and the protocol over its slots (descriptors,
locks, states). Readying its pages (pre-faulting, pinning them for a device) and reading them
back act on the same mapping, slot by slot, and are ordered by its life: pinning waits for
pre-faulting, and :meth:`Segment.close` unpins before it unmaps. Apart, each would hold a
mapping it does not own.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import struct
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planaria.shm import SHM_DIR as SHM_DIR
from planaria.shm import UnsafePathError, create_file, open_file, remove_dir

if TYPE_CHECKING:
    import torch

    from planaria.checkpoint.device import Device

MAGIC = b"PLNRSHM1"
VERSION = 2
PAGE = mmap.PAGESIZE
HEADER = struct.Struct("<8sIIQq")  # magic, version, slots, capacity, creator pid
DESC = struct.Struct("<IIqqqqqqd")  # state, pad, step, rank, world, seq, data_len, meta_len, time
DESC_OFFSET = 64
SLOTS = 3
EMPTY, WRITING, VALID = 0, 1, 2


class SegmentError(RuntimeError):
    """A segment that is not ours or cannot hold the state."""


class SegmentBusyError(SegmentError):
    """Every slot a save may write is held by a reader (a persister that stopped answering)."""


@dataclass(frozen=True)
class SlotInfo:
    slot: int
    state: int
    step: int
    rank: int
    world: int
    seq: int
    data_len: int
    meta_len: int
    time: float

    @property
    def valid(self) -> bool:
        return self.state == VALID


def _page_align(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


class Segment:
    """One rank's segment, mapped read-write (the worker) or read-only (persister, agent)."""

    def __init__(self, path: Path, fd: int, mapping: mmap.mmap, capacity: int) -> None:
        self.path = path
        self._fd = fd
        self._map = mapping
        self.capacity = capacity
        self._prefault: threading.Thread | None = None
        self._prefaulting: set[int] = set()
        self._registered: dict[str, tuple[Device, dict[int, int]]] = {}
        """Device kind -> (device, {slot: address}) of the slots registered as pinned host
        memory."""
        self._registering: threading.Thread | None = None
        self._unpinnable: set[str] = set()
        """Device kinds whose runtime refused to register the mapping (not tried again)."""
        self._register_lock = threading.Lock()

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def create(cls, path: Path, capacity: int) -> Segment:
        """A new, empty segment of ``SLOTS`` slots of ``capacity`` bytes (replacing any)."""
        capacity = _page_align(max(capacity, PAGE))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
        fd = create_file(tmp)
        try:
            os.ftruncate(fd, PAGE + SLOTS * capacity)
            mapping = mmap.mmap(fd, PAGE + SLOTS * capacity)
            HEADER.pack_into(mapping, 0, MAGIC, VERSION, SLOTS, capacity, os.getpid())
            for slot in range(SLOTS):
                DESC.pack_into(
                    mapping, DESC_OFFSET + slot * DESC.size, EMPTY, 0, -1, 0, 0, 0, 0, 0, 0.0
                )
            os.replace(tmp, path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return cls(path, fd, mapping, capacity)

    @classmethod
    def open(cls, path: Path, *, writable: bool = False) -> Segment:
        """An existing segment; :class:`SegmentError` if it is not one (or not this user's
        own file: a link or another user's file is never read nor written)."""
        try:
            fd = open_file(path, os.O_RDWR if writable else os.O_RDONLY)
        except UnsafePathError as exc:
            raise SegmentError(str(exc)) from None
        try:
            size = os.fstat(fd).st_size
            if size < PAGE:
                raise SegmentError(f"{path} is not a planaria checkpoint segment ({size} bytes)")
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            mapping = mmap.mmap(fd, size, access=access)
            magic, version, slots, capacity, _ = HEADER.unpack_from(mapping, 0)
            if magic != MAGIC or version != VERSION or slots != SLOTS:
                mapping.close()
                raise SegmentError(f"{path} is not a planaria checkpoint segment (bad header)")
            if size != PAGE + SLOTS * capacity:
                mapping.close()
                raise SegmentError(f"{path} is truncated: {size} bytes for capacity {capacity}")
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mapping, capacity)

    def close(self) -> None:
        if self._prefault is not None:
            self._prefault.join()
        if self._registering is not None:
            self._registering.join()
        self.unregister_host()
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    # -- pre-faulting ----------------------------------------------------------------------

    def prefault(
        self, *, fresh: bool, background: bool = True, slots: tuple[int, ...] = tuple(range(SLOTS))
    ) -> None:
        """Map the pages of ``slots`` now so that saves copy at memory speed.

        A fresh segment's pages do not exist yet: writing zeros allocates them (torch spreads
        that over its threads, and releases the GIL). A reused segment already holds pages,
        perhaps a step to restore: only the page tables are filled, nothing is written."""

        def run() -> None:
            for slot in slots:
                start = PAGE + slot * self.capacity
                if fresh:
                    import torch

                    view = torch.frombuffer(
                        self._map, dtype=torch.uint8, count=self.capacity, offset=start
                    )
                    view.fill_(0)
                    del view
                    continue
                try:
                    self._map.madvise(_MADV_POPULATE_WRITE, start, self.capacity)
                except OSError:  # an older kernel: touching a byte per page does the same
                    for offset in range(start, start + self.capacity, PAGE):
                        self._map[offset] = self._map[offset]

        self.wait_prefault()
        if background:
            self._prefaulting = set(slots)
            self._prefault = threading.Thread(target=run, name="planaria-prefault", daemon=True)
            self._prefault.start()
        else:
            run()

    def wait_prefault(self) -> None:
        if self._prefault is not None:
            self._prefault.join()
            self._prefault = None
        self._prefaulting = set()

    # -- pinned host memory ----------------------------------------------------------------

    def register_host(
        self,
        device: Device,
        *,
        background: bool,
        slots: tuple[int, ...] = tuple(range(SLOTS)),
    ) -> None:
        """Register ``slots`` with ``device``'s runtime as pinned host memory, each once, so
        that device copies to and from them run at the link's speed (a pageable copy runs at a
        fraction of it). Each slot is a registration of its own: a restarted worker registers
        only the slot it restores from (registering costs about 0.23 s per 4 GiB on an H200,
        more than the copy), its first save the others. In the background it starts once
        pre-faulting is done (both touch every page); :meth:`close` undoes it before
        unmapping."""
        with self._register_lock:
            if not device.registers or device.kind in self._unpinnable:
                return
            if self._registering is not None:
                if background:
                    return
                self._registering.join()
                self._registering = None
            done = self._registered.setdefault(device.kind, (device, {}))[1]
            todo = [slot for slot in slots if slot not in done]
            if not todo:
                return
            prefault = self._prefault

            def run() -> None:
                if prefault is not None:
                    prefault.join()
                base = _address(self._map) + PAGE
                for slot in todo:
                    address = base + slot * self.capacity
                    try:
                        device.register(address, self.capacity)
                    except Exception as exc:  # copies still work, from pageable memory
                        self._unpinnable.add(device.kind)
                        _log().warning(
                            "cannot pin the checkpoint's shared memory; device copies will be "
                            "slower",
                            path=str(self.path),
                            error=str(exc),
                        )
                        return
                    done[slot] = address

            if background:
                self._registering = threading.Thread(
                    target=run, name="planaria-register", daemon=True
                )
                self._registering.start()
                return
        run()

    def registered(self, kind: str) -> bool:
        """Whether every slot is registered with ``kind``'s runtime (and done registering)."""
        thread = self._registering
        if thread is not None and not thread.is_alive():
            self._registering = None
        return len(self._registered.get(kind, (None, {}))[1]) == SLOTS

    def unregister_host(self) -> None:
        """Undo every :meth:`register_host` (before the mapping goes)."""
        if self._registering is not None:
            self._registering.join()
            self._registering = None
        for kind, (device, addresses) in list(self._registered.items()):
            for address in addresses.values():
                try:
                    device.unregister(address)
                except Exception as exc:
                    _log().warning(
                        "cannot unpin shared memory", path=str(self.path), error=str(exc)
                    )
            del self._registered[kind]

    # -- descriptors -----------------------------------------------------------------------

    def info(self, slot: int) -> SlotInfo:
        fields = DESC.unpack_from(self._map, DESC_OFFSET + slot * DESC.size)
        state, _, step, rank, world, seq, data_len, meta_len, when = fields
        return SlotInfo(slot, state, step, rank, world, seq, data_len, meta_len, when)

    def infos(self) -> list[SlotInfo]:
        return [self.info(slot) for slot in range(SLOTS)]

    def valid(self) -> list[SlotInfo]:
        """Valid slots, newest first."""
        return sorted((i for i in self.infos() if i.valid), key=lambda i: -i.seq)

    def _set(self, slot: int, info: SlotInfo) -> None:
        DESC.pack_into(
            self._map,
            DESC_OFFSET + slot * DESC.size,
            info.state,
            0,
            info.step,
            info.rank,
            info.world,
            info.seq,
            info.data_len,
            info.meta_len,
            info.time,
        )

    # -- locks -----------------------------------------------------------------------------

    def _lock(self, slot: int, kind: int) -> None:
        fcntl.lockf(self._fd, kind, DESC.size, DESC_OFFSET + slot * DESC.size, os.SEEK_SET)

    def pin(self, step: int) -> SlotInfo:
        """Hold the slot that has ``step`` under a shared lock, so no save overwrites it until
        :meth:`unpin`; :class:`LookupError` if no valid slot has it."""
        for info in self.valid():
            if info.step != step:
                continue
            self._lock(info.slot, fcntl.LOCK_SH)
            held = self.info(info.slot)  # it may have changed before we held the lock
            if held.valid and held.step == step and held.seq == info.seq:
                return held
            self._lock(info.slot, fcntl.LOCK_UN)
        raise LookupError(f"{self.path} holds no complete copy of step {step}")

    def unpin(self, info: SlotInfo) -> None:
        self._lock(info.slot, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def reading(self, step: int) -> Iterator[SlotInfo]:
        """:meth:`pin` for the duration of a ``with`` block."""
        info = self.pin(step)
        try:
            yield info
        finally:
            self.unpin(info)

    def data(self, info: SlotInfo) -> memoryview:
        start = PAGE + info.slot * self.capacity
        return memoryview(self._map)[start : start + info.data_len]

    def payload(self, info: SlotInfo) -> memoryview:
        """The slot's data and metadata, as one view (what a peer's replica copies)."""
        start = PAGE + info.slot * self.capacity
        return memoryview(self._map)[start : start + info.data_len + info.meta_len]

    def inode(self) -> int:
        """The mapped file's inode: a path that names another one was made anew."""
        return os.fstat(self._fd).st_ino

    def meta(self, info: SlotInfo) -> dict[str, Any]:
        start = PAGE + info.slot * self.capacity + info.data_len
        raw = bytes(self._map[start : start + info.meta_len])
        meta: dict[str, Any] = json.loads(raw)
        return meta

    def tensor(self, info: SlotInfo, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over ``nbytes`` of the slot's data (no copy)."""
        import torch

        start = PAGE + info.slot * self.capacity + offset
        if offset + nbytes > info.data_len:
            raise SegmentError(f"{self.path}: tensor at {offset}+{nbytes} beyond slot data")
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():  # a read-only map: callers only copy out of it
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=start)

    def read_into(self, info: SlotInfo, reads: list[tuple[torch.Tensor, int]]) -> None:
        """Fill contiguous CPU tensors, each from its offset in the slot, with ``preadv``.

        For a process that has not touched the segment (a restarted worker), the kernel then
        copies straight from the shared pages, instead of this process first filling its page
        tables for the whole mapping; 16 MiB pieces go over a few threads (the GIL is released
        while the kernel copies)."""
        import ctypes

        import torch

        base = PAGE + info.slot * self.capacity
        pieces: list[tuple[int, int, int]] = []  # (address, file offset, length)
        for target, offset in reads:
            nbytes = target.numel() * target.element_size()
            if offset + nbytes > info.data_len:
                raise SegmentError(f"{self.path}: tensor at {offset}+{nbytes} beyond slot data")
            address = target.data_ptr()
            for start in range(0, nbytes, _READ_PIECE):
                length = min(_READ_PIECE, nbytes - start)
                pieces.append((address + start, base + offset + start, length))
        errors: list[BaseException] = []

        def work(first: int, stride: int) -> None:
            try:
                for address, offset, length in pieces[first::stride]:
                    buffer = memoryview((ctypes.c_char * length).from_address(address)).cast("B")
                    done = 0
                    while done < length:
                        got = os.preadv(self._fd, [buffer[done:]], offset + done)
                        if got <= 0:
                            raise SegmentError(f"{self.path}: short read at {offset + done}")
                        done += got
            except BaseException as exc:
                errors.append(exc)

        threads = max(1, min(torch.get_num_threads(), 4, len(pieces)))
        helpers = [
            threading.Thread(target=work, args=(k, threads), daemon=True) for k in range(1, threads)
        ]
        for thread in helpers:
            thread.start()
        work(0, threads)
        for thread in helpers:
            thread.join()
        if errors:
            raise errors[0]

    # -- writing (the worker) --------------------------------------------------------------

    @contextlib.contextmanager
    def writing(self, wait: float | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """Choose a slot that does not hold the newest complete step and that no reader holds
        (the oldest first), and hold it exclusively; yields (slot, a uint8 tensor over its
        whole capacity). The slot is marked ``WRITING``; :meth:`publish` marks it valid.

        The newest step is never written over, whatever readers hold: if every other slot is
        held, the save waits for one, at most ``wait`` seconds (None: as long as it takes),
        then raises :class:`SegmentBusyError`. A slot still being pre-faulted is waited for."""
        import torch

        with self.writing_bytes(wait) as (chosen, _):
            start = PAGE + chosen * self.capacity
            view = torch.frombuffer(self._map, dtype=torch.uint8, count=self.capacity, offset=start)
            yield chosen, view

    @contextlib.contextmanager
    def writing_bytes(self, wait: float | None = None) -> Iterator[tuple[int, memoryview]]:
        """:meth:`writing`, yielding a memoryview of the slot: for a process that fills it
        from a socket (a peer's replica) and has no use for torch."""
        valid = self.valid()
        newest = valid[0].slot if valid else -1
        infos = {i.slot: i for i in self.infos()}
        order = sorted(
            (slot for slot in range(SLOTS) if slot != newest),
            key=lambda slot: (infos[slot].valid, infos[slot].seq, slot),
        )
        deadline = None if wait is None else time.monotonic() + wait
        chosen = None
        pause = 0.0005
        while chosen is None:
            for slot in order:
                try:
                    self._lock(slot, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue
                chosen = slot
                break
            if chosen is not None:
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise SegmentBusyError(
                    f"{self.path}: every slot but the newest step's is held by a reader "
                    f"(waited {wait:g}s)"
                )
            time.sleep(pause)  # polled: a blocking lockf cannot be given a deadline
            pause = min(pause * 2, 0.02)
        if chosen in self._prefaulting:
            self.wait_prefault()
        try:
            old = self.info(chosen)
            self._set(
                chosen, SlotInfo(chosen, WRITING, -1, old.rank, old.world, old.seq, 0, 0, 0.0)
            )
            start = PAGE + chosen * self.capacity
            view = memoryview(self._map)[start : start + self.capacity]
            try:
                yield chosen, view
            finally:
                view.release()
        finally:
            self._lock(chosen, fcntl.LOCK_UN)

    def publish(
        self, slot: int, *, step: int, rank: int, world: int, data_len: int, meta: bytes
    ) -> SlotInfo:
        """Write the metadata after the data and mark the slot valid (call inside
        :meth:`writing`)."""
        if data_len + len(meta) > self.capacity:
            raise SegmentError(
                f"{self.path}: {data_len + len(meta)} bytes do not fit a slot of {self.capacity}"
            )
        start = PAGE + slot * self.capacity + data_len
        self._map[start : start + len(meta)] = meta
        seq = max(i.seq for i in self.infos()) + 1
        info = SlotInfo(slot, VALID, step, rank, world, seq, data_len, len(meta), time.time())
        self._set(slot, info)
        return info


def _address(mapping: mmap.mmap) -> int:
    """The address of a writable mapping's first byte (the export ends at once)."""
    import ctypes

    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


def _log() -> Any:
    from planaria.log import get_logger

    return get_logger("checkpoint")


_MADV_POPULATE_WRITE = 23
_READ_PIECE = 16 << 20


def remove_segments(prefix: str) -> int:
    """Remove every segment (and leftover temporary file) under ``prefix``; how many. A
    private directory of ours (:mod:`planaria.shm`) goes whole."""
    base = Path(prefix)
    if base.is_dir() and not base.is_symlink():
        return int(remove_dir(base))
    removed = 0
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(base.parent):
            if name.startswith(base.name) or name.startswith(f".{base.name}"):
                if (base.parent / name).is_dir():
                    removed += remove_dir(base.parent / name)
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(base.parent / name)
                    removed += 1
    return removed
