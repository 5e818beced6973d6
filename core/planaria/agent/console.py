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
hands each line to a :class:`ConsoleBuffer`, which only appends to a bounded list; a line that
does not fit (the master, or the terminal behind it, cannot keep up) is dropped and counted,
and the console says how many. The agent sends what is pending every :data:`INTERVAL` seconds,
one request at a time, in requests of at most :data:`REQUEST_BYTES` of text.

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


class ConsoleBuffer:
    """The lines a node's workers wrote and the console has not had yet; thread-safe, never
    blocks (see the module's docstring)."""

    def __init__(
        self, max_bytes: int = MAX_PENDING_BYTES, max_lines: int = MAX_PENDING_LINES
    ) -> None:
        self.max_bytes, self.max_lines = max_bytes, max_lines
        self._lock = threading.Lock()
        self._lines: list[OutputLine] = []
        self._bytes = 0
        self._dropped = 0
        self._partial: dict[object, bytes] = {}
        self._redraw: dict[object, int] = {}
        """A pipe's last pending line, when it ended with a bare ``\\r``: its index."""

    def feed(self, key: object, rank: int, stream: Stream, data: bytes) -> None:
        """What the pipe ``key`` (of rank ``rank``) gave: its whole lines become pending."""
        with self._lock:
            buf, pos = self._partial.pop(key, b"") + data, 0
            # A \r at the very end may be half of a \r\n: it waits for the next read.
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

    def end(self, key: object, rank: int, stream: Stream) -> None:
        """The pipe ``key`` ended: its unfinished last line is a line too."""
        with self._lock:
            rest = self._partial.pop(key, b"").rstrip(b"\r")
            if rest:
                self._add(key, rank, stream, rest, False)
            self._redraw.pop(key, None)  # the key (a file descriptor) may be reused

    def _add(self, key: object, rank: int, stream: Stream, raw: bytes, redraw: bool) -> None:
        if redraw:
            raw = raw.rstrip()
            if not raw:  # a redraw starts with \r: nothing before it
                return
        text = raw.decode("utf-8", "replace")
        line = OutputLine.model_construct(rank=rank, text=text, stream=stream)
        size = len(raw) + 16
        replace = self._redraw.pop(key, None)
        if replace is not None:
            old = self._lines[replace]
            self._bytes += size - len(old.text) - 16
            self._lines[replace] = line
            index = replace
        elif len(self._lines) >= self.max_lines or self._bytes + size > self.max_bytes:
            self._dropped += 1
            return
        else:
            self._lines.append(line)
            self._bytes += size
            index = len(self._lines) - 1
        if redraw:
            self._redraw[key] = index

    def take(self) -> tuple[list[OutputLine], int]:
        """The pending lines, and how many were dropped since the last take; both reset."""
        with self._lock:
            lines, dropped = self._lines, self._dropped
            self._lines, self._bytes, self._dropped = [], 0, 0
            self._redraw.clear()
            return lines, dropped

    def give_back(self, dropped: int) -> None:
        """Lines taken that could not be sent: counted as dropped."""
        with self._lock:
            self._dropped += dropped
