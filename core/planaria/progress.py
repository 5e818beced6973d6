"""The progress board: how workers tell their agent which step they reached, for free.

The agent creates one small file in its node's private directory in /dev/shm (mode 0600, created
exclusively: :mod:`planaria.shm`) with one slot per local rank;
each worker maps it and writes its slot on every step (no system call, no lock: one writer per
slot). The agent reads the slots to show progress, to detect hangs and to time recovery.

Slot layout (little endian, 40 bytes): step (int64), wall time of that step (float64),
pid (int64), busy time of that step in nanoseconds (int64), the first step this process
completed (int64). A step of -1 means "no step yet"; a busy time of -1, "not measured" (the first
step of a process has no start to measure from). The first step is the worker's own record, so
the steps a fault cost are counted from what the workers did, however late the agent looks.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from planaria.shm import create_file, open_file

SLOT = struct.Struct("<qdqqq")
ENV = "PLANARIA_PROGRESS_FILE"


@dataclass(frozen=True)
class Progress:
    step: int
    time: float
    pid: int
    busy: float | None = None
    """The CPU time (or the busy time the worker gave) of that step, in seconds."""
    first: int = -1
    """The first step the process in this slot completed (-1: none yet)."""


class ProgressBoard:
    """The agent's side: create, reset and read the slots."""

    def __init__(self, path: Path, slots: int) -> None:
        self.path = path
        self.slots = slots
        fd = create_file(path)
        try:
            os.ftruncate(fd, SLOT.size * slots)
            self._map = mmap.mmap(fd, SLOT.size * slots)
        finally:
            os.close(fd)
        self.reset()

    def reset(self) -> None:
        for slot in range(self.slots):
            SLOT.pack_into(self._map, slot * SLOT.size, -1, 0.0, 0, -1, -1)

    def read(self, slot: int) -> Progress:
        step, when, pid, busy, first = SLOT.unpack_from(self._map, slot * SLOT.size)
        return Progress(step, when, pid, busy / 1e9 if busy >= 0 else None, first)

    def read_all(self) -> list[Progress]:
        return [self.read(slot) for slot in range(self.slots)]

    def close(self) -> None:
        self._map.close()
        self.path.unlink(missing_ok=True)


class ProgressSlot:
    """A worker's side: its one slot."""

    def __init__(self, path: str, slot: int) -> None:
        fd = open_file(Path(path))
        try:
            self._map = mmap.mmap(fd, SLOT.size * (slot + 1))
        finally:
            os.close(fd)
        self._offset = slot * SLOT.size
        self._pid = os.getpid()
        self._first = -1

    def write(self, step: int, when: float, busy: float | None = None) -> None:
        nanos = -1 if busy is None else max(0, int(busy * 1e9))
        if self._first < 0:
            self._first = step
        SLOT.pack_into(self._map, self._offset, step, when, self._pid, nanos, self._first)
