"""Worker output into capped, rotated log files (``logs/rank-N.log``, ``.1`` ... ``.keep``).

A worker writes into a pipe, never into its log file: the file's size is then the agent's to
bound. One thread per launcher (:class:`LogPump`) reads every worker's pipe and appends to its
log; a log that would pass ``max_bytes`` is rotated (``rank-N.log`` -> ``rank-N.log.1`` ...,
the oldest dropped), so a worker's output takes at most ``max_bytes * (keep + 1)`` on disk and
the newest output is always kept. The thread only copies bytes, so a worker writes at pipe
speed whatever the agent's event loop is doing; a write the disk refuses (full) is dropped and
counted, never retried, so that a full disk cannot stop the pipe from draining.

A pipe may also show on the console (:mod:`planaria.agent.console`): its :class:`Source` names
the rank and the stream, and the thread hands what it copied to the console's buffer, which
never blocks. A worker whose two streams go different ways (one kept off the console) writes
them into two pipes that share its log; their lines are in the log in the order the thread
reads them, which keeps each stream's order but may swap a stdout and a stderr line written
within the same instant.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import threading
from dataclasses import dataclass, field
from pathlib import Path

from planaria.agent.console import ConsoleBuffer
from planaria.log import get_logger
from planaria.protocol import Stream

log = get_logger("agent.logs")

CHUNK = 1 << 16
PIPE_BYTES = 1 << 20
"""The pipe's buffer, where the kernel allows it: a burst of output does not wait for the
thread's next turn."""


@dataclass(frozen=True)
class LogLimits:
    max_bytes: int = 100 << 20
    """The most one log file holds before it is rotated."""
    keep: int = 3
    """Rotated files kept besides the current one."""


@dataclass(frozen=True)
class Source:
    """A pipe whose lines also go to the console: the worker's global rank, and which stream
    the pipe carries (``output``: stdout and stderr both)."""

    rank: int
    stream: Stream = "output"


@dataclass
class _Pipe:
    log: RotatingLog
    source: Source | None
    partial: bytearray = field(default_factory=bytearray)
    """The end of a line not yet in the log, held while another pipe (the worker's other
    stream) shares the log, so that two streams' lines are never torn into each other (an
    unbuffered ``print`` writes a line's text and its newline apart)."""


HOLD = 1 << 16
"""The most of a line held back from a shared log: a longer one goes in as it is."""


class RotatingLog:
    """One worker's log file: appended to, rotated at ``max_bytes``."""

    def __init__(self, path: Path, limits: LogLimits) -> None:
        self.path, self.limits = path, limits
        self.dropped = 0
        """Bytes the disk refused."""
        self._fd = -1
        self._size = 0
        self._open()  # there from the start, as a redirect's would be; OSError if it cannot

    def _open(self) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        self._fd = os.open(self.path, flags, 0o600)
        self._size = os.fstat(self._fd).st_size

    def _rotate(self) -> None:
        self.close()
        keep = self.limits.keep
        name = str(self.path)
        if keep == 0:
            with contextlib.suppress(OSError):
                os.unlink(name)
            return
        for n in range(keep - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.replace(f"{name}.{n}", f"{name}.{n + 1}")
        with contextlib.suppress(FileNotFoundError):
            os.replace(name, f"{name}.1")

    def write(self, data: bytes) -> None:
        limit = self.limits.max_bytes
        try:
            if self._fd < 0:
                self._open()
            if len(data) > limit:  # only its end fits: the newest output is what counts
                self.dropped += len(data) - limit
                data = data[-limit:]
            if self._size + len(data) > limit:
                self._rotate()
                self._open()
            while data:
                n = os.write(self._fd, data)
                self._size += n
                data = data[n:]
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                log.warning("cannot write a worker's log", path=str(self.path), error=str(exc))
            self.dropped += len(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LogPump:
    """Copies the workers' pipes into their logs (and to the console), on a thread of its own."""

    def __init__(self, limits: LogLimits, console: ConsoleBuffer | None = None) -> None:
        self.limits = limits
        self.console = console
        self._logs: dict[int, _Pipe] = {}  # read end -> its log
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="planaria-worker-logs", daemon=True)
        self._thread.start()

    def pipe(self, path: Path, source: Source | None = None, header: bytes = b"") -> int:
        """A new pipe whose output goes to ``path`` (and, with a ``source``, to the console);
        returns its write end (the caller closes it once the worker holds it)."""
        read, write = os.pipe2(os.O_CLOEXEC)
        with contextlib.suppress(OSError):  # F_SETPIPE_SZ; a smaller buffer only waits more
            import fcntl

            fcntl.fcntl(write, 1031, PIPE_BYTES)
        try:
            self.add(read, path, source, header)
        except OSError:
            os.close(write)
            raise
        return write

    def add(self, read: int, path: Path, source: Source | None = None, header: bytes = b"") -> None:
        """Copy what comes out of ``read`` (a pipe's or FIFO's read end, now ours: closed
        here if the log cannot be opened, with the ``OSError``) to ``path``, after ``header``
        (a restart's mark). Pipes of one path share its log (and its cap)."""
        with self._lock:
            shared = next((p.log for p in self._logs.values() if p.log.path == path), None)
        try:
            rotating = shared or RotatingLog(path, self.limits)
        except OSError:
            os.close(read)
            raise
        if header:
            rotating.write(header)
        os.set_blocking(read, False)
        with self._lock:
            self._logs[read] = _Pipe(rotating, source if self.console is not None else None)
        os.write(self._wake_w, b"x")

    def discard(self, read: int) -> None:
        """Stop copying ``read`` (a FIFO no worker opened) and close it."""
        with self._lock:
            pipe = self._logs.pop(read, None)
            if pipe is not None:
                self._release(pipe)
                os.close(read)
        os.write(self._wake_w, b"x")

    def drain(self, path: Path) -> None:
        """Copy what the pipes of ``path`` hold now: a worker that exited is all in its log
        before its tail is read."""
        with self._lock:
            for fd, pipe in list(self._logs.items()):
                if pipe.log.path == path:
                    self._copy(fd, pipe)

    def _release(self, pipe: _Pipe) -> None:
        """A pipe is gone (lock held): its log closes when no other pipe shares it."""
        if all(other.log is not pipe.log for other in self._logs.values()):
            pipe.log.close()

    def _copy(self, fd: int, pipe: _Pipe) -> None:
        """Copy what ``fd`` holds (lock held); at its end, forget it."""
        source, console = pipe.source, self.console
        while True:
            try:
                data = os.read(fd, CHUNK)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # every writer is gone
                if pipe.partial:
                    self._to_log(pipe, b"", final=True)
                if source is not None and console is not None:
                    console.end(fd, source.rank, source.stream)
                self._logs.pop(fd, None)
                self._release(pipe)
                os.close(fd)
                return
            self._to_log(pipe, data)
            if source is not None and console is not None:
                console.feed(fd, source.rank, source.stream, data)

    def _to_log(self, pipe: _Pipe, data: bytes, final: bool = False) -> None:
        """Append ``data`` to the pipe's log (lock held): whole lines only while another pipe
        shares the log; the rest when the pipe ends, or once more than :data:`HOLD` waits."""
        shared = any(o is not pipe and o.log is pipe.log for o in self._logs.values())
        if not shared and not pipe.partial:
            pipe.log.write(data)
            return
        pipe.partial += data
        if final or not shared or len(pipe.partial) > HOLD:
            end = len(pipe.partial)
        else:
            end = max(pipe.partial.rfind(b"\n"), pipe.partial.rfind(b"\r")) + 1
        if end > 0:
            pipe.log.write(bytes(pipe.partial[:end]))
            del pipe.partial[:end]

    def _run(self) -> None:
        poller = select.poll()
        watched: set[int] = set()
        poller.register(self._wake_r, select.POLLIN)
        while not self._closed:
            with self._lock:
                current = set(self._logs)
            for fd in watched - current:
                poller.unregister(fd)
            for fd in current - watched:
                poller.register(fd, select.POLLIN)
            watched = current
            for fd, _ in poller.poll():
                if fd == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wake_r, 512):
                            pass
                    continue
                with self._lock:
                    pipe = self._logs.get(fd)
                    if pipe is not None:
                        self._copy(fd, pipe)

    def close(self) -> None:
        """Copy what is left, then stop; pipes still open are closed (their writers get
        EPIPE)."""
        self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join()
        with self._lock:
            for fd, pipe in list(self._logs.items()):
                self._copy(fd, pipe)
                if fd in self._logs:
                    if pipe.partial:
                        self._to_log(pipe, b"", final=True)
                    self._logs.pop(fd)
                    self._release(pipe)
                    os.close(fd)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def dropped(self) -> int:
        with self._lock:
            logs = {id(p.log): p.log for p in self._logs.values()}
            return sum(rotating.dropped for rotating in logs.values())
