"""The workers' output on the ``planaria run`` console, each line prefixed with its rank.

Where the lines go. Each agent forwards its workers' lines to the job master, and the master
prints them on the console of ``planaria run``, among its own event lines. That is where a
torchrun user looks: torchrun prints its workers' output on the console it runs in, and under
``srun torchrun`` every node's output ends up in the one output of the Slurm step. An agent's
own stdout would be that place only on some schedulers (a Kubernetes pod's log, a Ray worker's
log file, the local scheduler's ``logs/agents/``): the master's console is the same on all of
them. Every line is in the rank's log as well (:mod:`planaria.agent.worker_logs`), whatever the
console shows.

Training never waits for the console. The thread that copies a worker's pipe into its log
hands what it read to a :class:`ConsoleBuffer`, which only keeps it, up to a bound; what does
not fit (the master, or the terminal behind it, cannot keep up) is dropped and its lines
counted, and the console says how many. The agent sends what is pending every
:data:`INTERVAL` seconds, one request at a time, in requests of at most
:data:`REQUEST_BYTES` of text.

A progress bar redraws its line with ``\\r``: a ``\\r`` ends a console line too, and the next
line of the same pipe replaces it while it is unsent, so the console shows a bar's latest
state every interval, not every redraw.

The prefix is ``[rankN]:``, N the worker's global rank (torchrun's ``[default0]:`` is the role
and the local rank, which repeats on every node): it names the log the line is in
(``rank-N.log``) and matches the ``[rankN]:`` that PyTorch puts before its own messages.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping

from planaria.protocol import JobSpec, OutputLine, Stream

INTERVAL = 0.2
"""Seconds between two sends of a node's pending lines."""
MAX_PENDING_BYTES = 1 << 20
MAX_PENDING_LINES = 10_000
"""What a node holds for the console before it drops lines."""
MAX_LINE = 8192
"""A longer line is cut into pieces of this size (its whole is in the log)."""
REQUEST_BYTES = 256 << 10
"""The most text one request carries: well under the master's ``max_request_bytes`` (1 MiB
by default) even where JSON escapes control characters."""

_ENDS = re.compile(rb"\r\n|\n|\r")


def prefix(rank: int) -> str:
    """``[rank3]: ``: what every console line of rank 3 starts with."""
    return f"[rank{rank}]: "


def _of(value: int | Mapping[int, int], local_rank: int) -> int:
    return value.get(local_rank, 0) if isinstance(value, Mapping) else value


def console_streams(spec: JobSpec, local_rank: int) -> int:
    """The streams of a worker the console shows (1 stdout, 2 stderr, 3 both, 0 neither), as
    torchrun decides them: a redirected stream is only in the log, unless it is also tee'd."""
    if not spec.console:
        return 0
    if spec.local_ranks_filter is not None and local_rank not in spec.local_ranks_filter:
        return 0
    redirected = _of(spec.redirects, local_rank) & ~_of(spec.tee, local_rank)
    return 3 & ~redirected


def batches(lines: list[OutputLine], limit: int = REQUEST_BYTES) -> list[list[OutputLine]]:
    """``lines`` in order, cut into requests of at most ``limit`` bytes of text each."""
    out: list[list[OutputLine]] = []
    size = limit
    for line in lines:
        cost = len(line.text) + 16
        if size + cost > limit and (not out or out[-1]):
            out.append([])
            size = 0
        out[-1].append(line)
        size += cost
    return out


_END = b""
"""A pipe's end, in the pending chunks."""
_CUT_OPEN, _CUT_CLOSED = 0, 1
"""Chunks of a pipe were dropped here, in the pending chunks: the last one dropped ended in
the middle of a line (whose rest comes next), or at a line's end."""


class ConsoleBuffer:
    """The output a node's workers wrote and the console has not had yet; thread-safe.

    :meth:`feed` runs on the thread that drains the workers' pipes, so it does next to nothing:
    it keeps the chunk as it came, or, when :data:`MAX_PENDING_BYTES` are pending, counts its
    line ends as dropped lines (a C loop over the bytes). The lines are cut out of the chunks
    by :meth:`take`, on the thread that sends them."""

    def __init__(
        self, max_bytes: int = MAX_PENDING_BYTES, max_lines: int = MAX_PENDING_LINES
    ) -> None:
        self.max_bytes, self.max_lines = max_bytes, max_lines
        self._lock = threading.Lock()
        self._chunks: list[tuple[object, int, Stream, bytes | int]] = []
        self._bytes = 0
        self._dropped = 0
        self._cut: dict[object, tuple[int, Stream, int]] = {}
        """Pipes whose last chunk was dropped: their rank, stream and cut."""
        # The taker's own state (one taker at a time):
        self._partial: dict[object, bytes] = {}
        self._skip: set[object] = set()
        """Pipes whose next bytes, up to a line end, are the rest of a dropped line."""
        self._redraw: dict[object, int] = {}
        self._lines: list[OutputLine] = []
        self._taken_dropped = 0

    def feed(self, key: object, rank: int, stream: Stream, data: bytes) -> None:
        """What the pipe ``key`` (of rank ``rank``) gave."""
        with self._lock:
            if self._bytes + len(data) > self.max_bytes:
                self._dropped += data.count(b"\n")  # the lines whose ends are dropped
                cut = _CUT_CLOSED if data.endswith(b"\n") else _CUT_OPEN
                self._cut[key] = (rank, stream, cut)
                return
            if key in self._cut:
                self._chunks.append((key, rank, stream, self._cut.pop(key)[2]))
            self._chunks.append((key, rank, stream, data))
            self._bytes += len(data)

    def end(self, key: object, rank: int, stream: Stream) -> None:
        """The pipe ``key`` ended: its unfinished last line is a line too."""
        with self._lock:
            if key in self._cut:
                self._chunks.append((key, rank, stream, self._cut.pop(key)[2]))
            self._chunks.append((key, rank, stream, _END))

    def take(self) -> tuple[list[OutputLine], int]:
        """The lines pending, and how many were dropped since the last take."""
        with self._lock:
            chunks, dropped = self._chunks, self._dropped
            # A pipe cut now is told now (and again when it goes on, if the cut changed).
            chunks += [(key, *cut) for key, cut in self._cut.items()]
            self._chunks, self._bytes, self._dropped = [], 0, 0
        self._lines, self._taken_dropped = [], dropped
        self._redraw.clear()
        for key, rank, stream, data in chunks:
            if isinstance(data, int):  # the line in progress lost its rest (counted)
                self._partial.pop(key, None)
                if data == _CUT_OPEN:
                    self._skip.add(key)  # what comes next, to a line end, is a lost line's
                else:
                    self._skip.discard(key)
            elif data == _END:
                rest = self._partial.pop(key, b"").rstrip(b"\r")
                if rest and key not in self._skip:
                    self._add(key, rank, stream, rest, False)
                self._skip.discard(key)
                self._redraw.pop(key, None)  # the key (a file descriptor) may be reused
            else:
                self._split(key, rank, stream, data)
        lines, dropped = self._lines, self._taken_dropped
        self._lines = []
        return lines, dropped

    def _split(self, key: object, rank: int, stream: Stream, data: bytes) -> None:
        if key in self._skip:  # the rest of a dropped line
            at = data.find(b"\n")
            if at < 0:
                return
            self._skip.discard(key)
            self._taken_dropped += 1
            data = data[at + 1 :]
        buf, pos = self._partial.pop(key, b"") + data, 0
        # A \r at the very end may be half of a \r\n: it waits for the next chunk.
        whole = buf[:-1] if buf.endswith(b"\r") else buf
        for end in _ENDS.finditer(whole):
            self._add(key, rank, stream, buf[pos : end.start()], end.group() == b"\r")
            pos = end.end()
        rest = buf[pos:]
        while len(rest) > MAX_LINE:
            self._add(key, rank, stream, rest[:MAX_LINE], False)
            rest = rest[MAX_LINE:]
        if rest:
            self._partial[key] = rest

    def _add(self, key: object, rank: int, stream: Stream, raw: bytes, redraw: bool) -> None:
        if redraw:
            raw = raw.rstrip()
            if not raw:  # a redraw starts with \r: nothing before it
                return
        line = OutputLine.model_construct(
            rank=rank, text=raw.decode("utf-8", "replace"), stream=stream
        )
        replace = self._redraw.pop(key, None)
        if replace is not None:
            self._lines[replace] = line
            index = replace
        elif len(self._lines) >= self.max_lines:
            self._taken_dropped += 1
            return
        else:
            self._lines.append(line)
            index = len(self._lines) - 1
        if redraw:
            self._redraw[key] = index

    def give_back(self, dropped: int) -> None:
        """Lines taken that could not be sent: counted as dropped."""
        with self._lock:
            self._dropped += dropped
