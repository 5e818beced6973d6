"""Finding and ending every process a run started, wherever it went: a marker in the environment.

Killing a session or a process group (:mod:`planaria.process`) misses what left it: a launcher's
workers that called ``setsid``, a daemon that double-forked, a child reparented to init when
its launcher died first, a process that ignores SIGTERM. What all of them keep is the
environment they were started with. So whatever a benchmark trial or a test session starts
gets a **marker** in its environment (``PLANARIA_TRACE=<random id>``, inherited by everything it
starts in turn), and :func:`survivors` finds every live process carrying it by reading
``/proc/*/environ``; :func:`kill_survivors` ends them and says which they were, so that the
caller can report what its own cleanup missed.

``/proc/PID/environ`` is the environment the process was *executed* with: changing
``os.environ`` later does not change it, and a forked child shows its parent's. A marker
survives ``setsid``, double forks and reparenting. It does not survive a process that drops
its environment: ``execve`` with a new one (``env -i``, ``subprocess`` with an ``env=`` that
leaves the variable out, a daemon manager starting a service), or a process that overwrites
the memory holding it (as ``setproctitle`` may). Processes of other users cannot be read unless
we are root, and are never found.

Markers nest: :func:`marked` adds one to those already in the variable (comma-separated), so a
test session's marker still finds what a benchmark it runs starts under the benchmark's own.

Standard library and :mod:`planaria.process` only (benchmarks use it without the rest of
planaria); Linux only (``/proc``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import signal
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass

from planaria.process import proc_stat, running

VARIABLE = "PLANARIA_TRACE"
"""The environment variable holding the markers, comma-separated."""

KILL_WAIT = 5.0
"""How long :func:`kill_survivors` keeps killing: SIGKILL ends a process within milliseconds,
unless it is stuck in the kernel (uninterruptible I/O); such a one is returned all the same."""

_POLL = 0.05
_KEY = VARIABLE.encode() + b"="


@dataclass(frozen=True)
class Survivor:
    """A live process that carries a marker."""

    pid: int
    ppid: int
    cmdline: str

    def __str__(self) -> str:
        command = self.cmdline.replace("\n", "\\n")
        command = command if len(command) <= 200 else command[:197] + "..."
        return f"pid {self.pid} (parent {self.ppid}): {command}"


def new_marker() -> str:
    """A fresh random marker (16 hex digits)."""
    return secrets.token_hex(8)


def _check(marker: str) -> str:
    if not marker or any(c in marker for c in ",=\0") or marker != marker.strip():
        raise ValueError(
            f"a {VARIABLE} marker must be a non-empty word without ',', '=', NUL or spaces "
            f"around it: {marker!r}"
        )
    return marker


def markers_in(env: Mapping[str, str]) -> list[str]:
    """The markers ``env`` carries, oldest first."""
    return [m for m in env.get(VARIABLE, "").split(",") if m]


def marked(env: Mapping[str, str], marker: str) -> dict[str, str]:
    """A copy of ``env`` that also carries ``marker`` (the markers it had are kept)."""
    have = markers_in(env)
    out = dict(env)
    out[VARIABLE] = ",".join([*have, _check(marker)] if marker not in have else have)
    return out


def unmarked(env: Mapping[str, str], marker: str | None = None) -> dict[str, str]:
    """A copy of ``env`` without ``marker``, or without any marker when it is None: for what a
    run starts on purpose to outlive it (a cluster's daemons that a test session shares)."""
    out = dict(env)
    keep = [] if marker is None else [m for m in markers_in(env) if m != marker]
    if keep:
        out[VARIABLE] = ",".join(keep)
    else:
        out.pop(VARIABLE, None)
    return out


@contextlib.contextmanager
def marking(marker: str | None = None) -> Iterator[str]:
    """Mark ``os.environ`` with ``marker`` (a new one by default) while the block runs, so that
    every process started in it inherits it; the previous value is put back after."""
    marker = _check(marker) if marker is not None else new_marker()
    before = os.environ.get(VARIABLE)
    os.environ[VARIABLE] = marked(os.environ, marker)[VARIABLE]
    try:
        yield marker
    finally:
        if before is None:
            os.environ.pop(VARIABLE, None)
        else:
            os.environ[VARIABLE] = before


def _wanted(markers: str | Iterable[str]) -> frozenset[bytes]:
    names = [markers] if isinstance(markers, str) else list(markers)
    return frozenset(_check(m).encode() for m in names)


def _carries(pid: int, wanted: frozenset[bytes]) -> bool:
    """Whether process ``pid`` is alive and was started with one of ``wanted`` (False when it
    vanished, is a zombie, whose environment reads empty, or cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:
        return False
    if _KEY not in environ:  # the common case: one search, no split
        return False
    for entry in environ.split(b"\0"):
        if entry.startswith(_KEY) and not wanted.isdisjoint(entry[len(_KEY) :].split(b",")):
            return True
    return False


def _describe(pid: int) -> Survivor:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().rstrip(b"\0").split(b"\0")
        command = b" ".join(argv).decode(errors="replace")
    except OSError:
        command = ""
    stat = proc_stat(pid)
    return Survivor(pid, 0 if stat is None else stat.ppid, command or "?")


def survivors(markers: str | Iterable[str], *, exclude: Collection[int] = ()) -> list[Survivor]:
    """Every live process (but this one and ``exclude``) carrying one of ``markers``, by pid:
    one scan of ``/proc``. Processes that vanish meanwhile or cannot be read are left out."""
    wanted = _wanted(markers)
    skip = {os.getpid(), *exclude}
    found = []
    try:
        entries = os.scandir("/proc")  # lists processes, not their threads
    except OSError:
        return []
    with entries:
        for entry in entries:
            if not entry.name.isdigit() or (pid := int(entry.name)) in skip:
                continue
            if _carries(pid, wanted):
                found.append(_describe(pid))
    return sorted(found, key=lambda s: s.pid)


def _kill(pid: int, wanted: frozenset[bytes]) -> bool:
    """SIGCONT and SIGKILL ``pid`` if it still carries a marker: through a pidfd opened before
    looking again, so that a pid reused meanwhile by another process is never signalled.
    Whether it was signalled."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):  # no pidfd here: the small race of a plain kill
        return _signal_if_carrying(pid, wanted, functools.partial(os.kill, pid))
    try:
        return _signal_if_carrying(pid, wanted, functools.partial(signal.pidfd_send_signal, fd))
    finally:
        os.close(fd)


def _signal_if_carrying(
    pid: int, wanted: frozenset[bytes], send: Callable[[signal.Signals], object]
) -> bool:
    if not _carries(pid, wanted):
        return False
    for sig in (signal.SIGCONT, signal.SIGKILL):
        with contextlib.suppress(OSError):
            send(sig)
    return True


def kill_survivors(
    markers: str | Iterable[str],
    grace: float = 0.0,
    *,
    exclude: Collection[int] = (),
    kill_wait: float = KILL_WAIT,
) -> list[Survivor]:
    """Kill every process carrying one of ``markers`` (but this one and ``exclude``) and return
    them, so that the caller can say what its own cleanup left; an empty list when none.

    ``grace``: how long processes already on their way out (a persister freeing its files, a
    launcher reaping its workers) may take before they count. Then SIGCONT and SIGKILL, again
    until none is found (a dying parent can still fork, and its child is caught by the next
    look), at most ``kill_wait`` seconds; one stuck in the kernel past that is returned too
    (:func:`survivors` tells whether it is still there). Returns once those it killed have
    exited: a process on its way out no longer shows its environment, but it may still run
    (closing its files) for a while on a busy machine. Costs one scan when nothing is found."""
    wanted = _wanted(markers)
    found = survivors(markers, exclude=exclude)
    deadline = time.monotonic() + grace
    while found and time.monotonic() < deadline:
        time.sleep(_POLL)
        found = survivors(markers, exclude=exclude)
    seen = {s.pid: s for s in found}
    killed: set[int] = set()
    deadline = time.monotonic() + kill_wait
    while found and time.monotonic() < deadline:
        killed.update(s.pid for s in found if _kill(s.pid, wanted))
        time.sleep(_POLL / 10)
        found = survivors(markers, exclude=exclude)
        seen.update((s.pid, s) for s in found if s.pid not in seen)
    while (killed := {pid for pid in killed if running(pid)}) and time.monotonic() < deadline:
        time.sleep(_POLL / 10)
    return sorted(seen.values(), key=lambda s: s.pid)


def _print(line: str) -> None:
    print(line, flush=True)


def describe(found: Iterable[Survivor]) -> str:
    """One line per survivor, for a warning or a test failure."""
    return "\n".join(f"  {s}" for s in found)


class Sweeper:
    """The markers of a series of runs (a benchmark's trials): each :meth:`trial` runs marked,
    what it left running is killed and reported after it, and :meth:`final` looks once more
    for any of them. Reports go to ``report`` (default: printed to stdout at once).

    As a context manager it makes that last check itself when the block did not (it ended
    early: an error, an interrupt), so that a failed benchmark still leaves nothing behind."""

    def __init__(self, grace: float = 5.0, report: Callable[[str], object] | None = None) -> None:
        self.grace = grace
        self.report = report or _print
        self.markers: list[str] = []
        self.killed: list[Survivor] = []
        """Every process a trial left behind, killed after it."""
        self._checked = True

    def __enter__(self) -> Sweeper:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._checked:
            self.final()

    @contextlib.contextmanager
    def trial(self, name: str) -> Iterator[str]:
        """Run the block with a new marker in ``os.environ``; after it (also on an error), kill
        and report what carries it."""
        marker = new_marker()
        self.markers.append(marker)
        self._checked = False
        try:
            with marking(marker):
                yield marker
        finally:
            found = kill_survivors(marker, self.grace)
            if found:
                self.killed += found
                self.report(
                    f"warning: {name} left {len(found)} process(es) running after its own "
                    f"cleanup, killed now:\n{describe(found)}"
                )

    def final(self) -> list[Survivor]:
        """Kill and return whatever carries any marker of the trials now, and say so."""
        self._checked = True
        found = kill_survivors(self.markers, self.grace) if self.markers else []
        if found:
            self.report(f"left behind: {len(found)} process(es), killed now:\n{describe(found)}")
        else:
            self.report(
                f"left behind: nothing (no process of the {len(self.markers)} trials is alive; "
                f"{len(self.killed)} killed after their trial)"
            )
        return found
