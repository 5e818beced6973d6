"""The progress board: how workers tell their agent which step they reached, for free.

The agent creates one small file in its node's private directory in /dev/shm (mode 0600, created
exclusively: :mod:`planaria.shm`) with one slot per local rank;
each worker maps it and writes its slot on every step (no system call, no lock: one writer per
slot). The agent reads the slots to show progress, to detect hangs and to time recovery.

Slot layout (little endian, 72 bytes): step (int64), wall time of that step (float64),
pid (int64), busy time of that step in nanoseconds (int64), the first step this process
completed (int64), the last training loss the worker reported (float64) and the step it was
reported with (int64), the tokens this process reported, summed over its steps (float64), and
the step it last reported tokens with (int64). A step of -1 means "no step yet"; a busy time of
-1, "not measured" (the first step of a process has no start to measure from); a loss step of
-1, "no loss reported"; a tokens step of -1, "no tokens reported".
The first step is the worker's own record, so the steps a fault cost are counted from what the
workers did, however late the agent looks. The loss stays in the slot until the next one: a
script that computes its loss every tenth step reports it then, and the agent's heartbeat
carries the last one. The tokens are a running sum, kept by the worker, which sees every step:
the agent reads the slot a few times a second at most, and a sum read late loses nothing.

One writer and no lock: the agent reads a slot twice and takes it when both reads agree, so
that a loss is never paired with another step's number (a write is a 72-byte copy; a read that
overlaps one is rare, and the next read is a few microseconds later).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from planaria.shm import create_file, open_file

SLOT = struct.Struct("<qdqqqdqdq")
READS = 5
"""Reads of a slot until two in a row agree (a worker writing it all along: the last one)."""
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
    loss: float | None = None
    """The last training loss the worker reported (:func:`planaria.monitor.step`)."""
    loss_step: int = -1
    """The step reported with :attr:`loss` (-1: none)."""
    tokens: float | None = None
    """The tokens the worker reported (:func:`planaria.monitor.step`), summed over this
    process's steps."""
    tokens_step: int = -1
    """The last step reported with tokens (-1: none)."""


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
            SLOT.pack_into(self._map, slot * SLOT.size, -1, 0.0, 0, -1, -1, 0.0, -1, 0.0, -1)

    def read(self, slot: int) -> Progress:
        start = slot * SLOT.size
        raw = self._map[start : start + SLOT.size]
        for _ in range(READS):
            again = self._map[start : start + SLOT.size]
            if again == raw:
                break
            raw = again
        step, when, pid, busy, first, loss, loss_step, tokens, tokens_step = SLOT.unpack(raw)
        return Progress(
            step,
            when,
            pid,
            busy / 1e9 if busy >= 0 else None,
            first,
            loss if loss_step >= 0 else None,
            loss_step,
            tokens if tokens_step >= 0 else None,
            tokens_step,
        )

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
        self._loss = 0.0
        self._loss_step = -1
        self._tokens = 0.0
        self._tokens_step = -1

    def write(
        self,
        step: int,
        when: float,
        busy: float | None = None,
        loss: float | None = None,
        tokens: float | None = None,
    ) -> None:
        """Write ``step``; ``loss`` (a finite float), when given, is the loss of this step and
        stays in the slot until the next one; ``tokens`` (finite, not negative), when given,
        are added to the sum of this process's."""
        nanos = -1 if busy is None else max(0, int(busy * 1e9))
        if self._first < 0:
            self._first = step
        if loss is not None:
            self._loss, self._loss_step = loss, step
        if tokens is not None:
            self._tokens += tokens
            self._tokens_step = step
        SLOT.pack_into(
            self._map,
            self._offset,
            step,
            when,
            self._pid,
            nanos,
            self._first,
            self._loss,
            self._loss_step,
            self._tokens,
            self._tokens_step,
        )
