"""The job's timeline: every event as one JSON line in ``events.jsonl``, handed to the
job's observers as it is written, and read back (:func:`last_steps`, :func:`last_tokens`) by a
resumed master. The
summary the run ends with is :mod:`planaria.master.summary`'s.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from planaria.events import EventKind, JobEvent, Payload
from planaria.master.tokens import TokenCount

TAIL = 1 << 20
"""Bytes of the timeline's end :func:`last_steps` reads: many samples of every node of a big
job, and a bounded read however long the job ran."""


def last_steps(path: Path, round_: int, tail: int = TAIL) -> dict[str, int]:
    """Each node's last sampled step of round ``round_`` in the timeline at ``path``, from
    its last ``tail`` bytes: what a resumed master knows of where training got before the
    master before it died. Lines that are no event (a partial last one) are passed over."""
    steps: dict[str, int] = {}
    for event in _tail_samples(path, tail):
        if event.node is not None and event.step is not None and event.data.get("round") == round_:
            steps[event.node] = max(steps.get(event.node, -1), event.step)
    return steps


def last_tokens(path: Path, tail: int = TAIL) -> TokenCount:
    """The job's token count as the last sample that had it left it, from the timeline's last
    ``tail`` bytes: a resumed master counts on from there rather than from zero (a count
    from none when no sample there has one)."""
    count = TokenCount()
    for event in _tail_samples(path, tail):
        total, seen, round_ = (event.data.get(k) for k in ("tokens", "round_tokens", "round"))
        if isinstance(total, int | float) and isinstance(seen, int | float) and type(round_) is int:
            count = TokenCount(float(total), round_, float(seen))
    return count


def _tail_samples(path: Path, tail: int) -> Iterator[JobEvent]:
    """The ``progress`` events in the last ``tail`` bytes of the timeline at ``path``."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - tail))
            data = f.read()
    except OSError:
        return
    lines = data.split(b"\n")
    if size > tail:
        lines = lines[1:]  # the first is cut
    for line in lines:
        if b'"progress"' not in line:
            continue
        try:
            event = JobEvent.from_line(line.decode("utf-8"))
        except (ValueError, TypeError):
            continue
        if event.kind is EventKind.PROGRESS:
            yield event


class Timeline:
    """Appends events to ``events.jsonl`` (0600) and hands each to ``observer``, then to those
    that :meth:`watch` it. An event that cannot be written (a full disk) is still handed on,
    and counted in :attr:`unwritten`: the job goes on, and its end is still told."""

    def __init__(self, path: Path, job: str, observer: Callable[[JobEvent], None]) -> None:
        self.path = path
        self.job = job
        self.observers = [observer]
        self.events: list[JobEvent] = []
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        self.unwritten = 0
        """Events that could not be written; :attr:`write_error` says why."""
        self.write_error = ""
        try:
            terminate(self._fd)
        except OSError as exc:  # a full disk: the next event's write says so too
            self.write_error = exc.strerror or str(exc)

    def emit(
        self,
        payload: Payload,
        message: str,
        *,
        node: str | None = None,
        rank: int | None = None,
        step: int | None = None,
    ) -> JobEvent:
        """Record an event of ``payload``'s kind; ``message`` says it in words."""
        event = JobEvent.of(payload, job=self.job, message=message, node=node, rank=rank, step=step)
        self.events.append(event)
        self._write((event.model_dump_json() + "\n").encode())
        for observer in self.observers:
            observer(event)
        return event

    def watch(self, observer: Callable[[JobEvent], None]) -> None:
        """Hand every later event to ``observer`` too (the master's metrics)."""
        self.observers.append(observer)

    def _write(self, line: bytes) -> None:
        try:
            written = os.write(self._fd, line)  # one append: no buffer holds a failed line
            if written < len(line):  # the disk filled mid-line: no partial line stays
                os.ftruncate(self._fd, os.lseek(self._fd, 0, os.SEEK_END) - written)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:
            self.unwritten += 1
            self.write_error = exc.strerror or str(exc)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def terminate(fd: int) -> None:
    """End the file of ``fd`` (open to read and append) with a newline if its last line has
    none: a master that died mid-write left a partial line, and the next event must start on
    a line of its own, not glue onto it (the damage would move into the middle of the
    timeline, and take a good event with it). The partial line is kept, not cut off: it may
    be a whole event that only lacks its newline; readers skip it if it is not."""
    size = os.fstat(fd).st_size
    if size and os.pread(fd, 1, size - 1) != b"\n":
        os.write(fd, b"\n")
