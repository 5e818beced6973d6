"""Starting and ending child processes safely: process groups, dying with the parent, and
killing a whole group with a grace period.

Groups. A child gets a session, and so a process group, of its own (``new_group``): ending it
signals the group, so whatever it started (dataloader processes, a script's ``sleep &``) goes
with it. A group id is its leader's pid. It cannot name a stranger while the leader is an
unreaped child of ours (a zombie keeps its pid) or any member lives, so signal a group before
reaping its leader (:func:`has_exited` looks without reaping).

Dying with the parent. Linux's ``PR_SET_PDEATHSIG`` is set by the child itself, never in a
``preexec_fn``: that runs Python between ``fork`` and ``exec``, which the :mod:`subprocess`
docs call unsafe when the parent has threads (the child can deadlock on a lock another thread
held at the fork), and the agent, the master and the health-check runner all have threads.
:func:`popen` and :func:`spawn` start the command through a tiny trampoline instead (``python
-I -S -c``: no site, no user code), which sets the signal, dies at once if the parent is already
gone, then ``exec``s the command, so the pid is the command's own; an ``exec`` failure comes back
through a pipe as the ``OSError`` Popen itself would raise. Our own Python children (the
persister, a benchmark, the zygote) call :func:`die_with` first thing instead and are started
with ``die_with_parent=False``: that saves a second interpreter start.

The kernel sends the death signal when the *thread* that forked the child exits, not the
process: start such a child from a thread that lives at least as long as the child should.

Standard library only, and nothing heavy at import (subprocess and asyncio are imported when
used): the warm zygote, which runs without the ``planaria`` package so that workers start with a
fresh interpreter's modules, loads this file by path.

Why one module: a process group's life, from its start (the trampoline, the death signal) to
its end (signalling and waiting out its members, read from ``/proc``), is one contract, and the
zygote's by-path load needs both ends of it: split, this file would have to load its sibling by
path too.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import asyncio.subprocess
    import subprocess

PR_SET_PDEATHSIG = 1

KILL_WAIT = 5.0
"""After SIGKILL a group normally empties within milliseconds; one still there after this long
is stuck in the kernel (uninterruptible I/O, a hung driver) and is returned, not waited for."""

_TERM_POLL = 0.02
_KILL_POLL = 0.005

# Runs in the child: set the death signal, die if the parent is gone already, then become the
# command. argv: ["-c", parent pid, status fd, command...]. A failed exec writes its errno.
_TRAMPOLINE = f"""\
import os, sys
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl({PR_SET_PDEATHSIG}, {int(signal.SIGKILL)}, 0, 0, 0)
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    os.kill(os.getpid(), {int(signal.SIGKILL)})
status = int(sys.argv[2])
os.set_inheritable(status, False)
try:
    os.execvp(sys.argv[3], sys.argv[3:])
except OSError as error:
    os.write(status, str(error.errno or 0).encode())
os._exit(127)
"""

# Popen arguments that would defeat what popen() and spawn() promise.
_REFUSED = {
    "preexec_fn": "it runs Python between fork and exec, unsafe in a threaded process; "
    "use die_with_parent=True, or call planaria.process.die_with() in a Python child",
    "shell": "commands never go through a shell: pass the argv list",
    "executable": "pass the program as args[0]",
    "start_new_session": "use new_group",
    "process_group": "use new_group",
}

_libc: Any = None


def libc() -> Any:
    """The C library, loaded once (load it before forking: a forked child should not dlopen)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def prctl(option: int, arg: int | bytes) -> None:
    """``prctl(option, arg)``; ``bytes`` are passed as a C string. ``OSError`` on failure,
    ``AttributeError`` where there is no prctl (not Linux)."""
    value = ctypes.create_string_buffer(arg) if isinstance(arg, bytes) else ctypes.c_ulong(arg)
    if libc().prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def die_with(parent: int, sig: int = signal.SIGKILL) -> bool:
    """Called first thing in a child: receive ``sig`` when ``parent`` (the thread that started
    this process) dies, and at once if it died already. False where the kernel cannot tell
    (not Linux): then only the check made now holds, and the child must poll ``getppid``."""
    try:
        prctl(PR_SET_PDEATHSIG, int(sig))
        told = True
    except (OSError, AttributeError):
        told = False
    if os.getppid() != parent:  # it died before the prctl took effect
        os.kill(os.getpid(), sig)
    return told


def _prepare(
    args: Sequence[str | os.PathLike[str]], new_group: bool, die_with_parent: bool, kw: Any
) -> tuple[list[str], list[str], dict[str, Any], tuple[int, int] | None]:
    """The command, the argv to start, Popen's arguments and the exec-status pipe (or None)."""
    command = [os.fspath(arg) for arg in args]
    if not command:
        raise ValueError("cannot start a process: the command is empty")
    for name, why in _REFUSED.items():
        if name in kw:
            raise TypeError(f"planaria.process does not take {name}=: {why}")
    options = dict(kw)
    if new_group:
        options["start_new_session"] = True
    if not die_with_parent:
        return command, command, options, None
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    options["pass_fds"] = (*options.get("pass_fds", ()), write_fd)
    trampoline = [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), str(write_fd)]
    return command, [*trampoline, *command], options, (read_fd, write_fd)


def _exec_error(report: bytes, program: str) -> OSError:
    try:
        number = int(report)
    except ValueError:
        number = 0
    return OSError(number, os.strerror(number) if number else "cannot execute", program)


def _read_to_end(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 64):
        chunks.append(chunk)
    return b"".join(chunks)


def popen(
    args: Sequence[str | os.PathLike[str]],
    *,
    new_group: bool = True,
    die_with_parent: bool = True,
    **kw: Any,
) -> subprocess.Popen[Any]:
    """``subprocess.Popen(args, **kw)`` in a session of its own (``new_group``), getting
    SIGKILL when the calling thread dies (``die_with_parent``; see the module docstring).
    Raises ``OSError`` when the command cannot be executed, as Popen does."""
    import subprocess

    command, argv, options, status = _prepare(args, new_group, die_with_parent, kw)
    if status is None:
        return subprocess.Popen(argv, **options)
    read_fd, write_fd = status
    try:
        try:
            proc = subprocess.Popen(argv, **options)
        finally:
            os.close(write_fd)
        report = _read_to_end(read_fd)  # end of file at the exec
    finally:
        os.close(read_fd)
    if report:
        with proc:  # closes its pipes and reaps it
            pass
        raise _exec_error(report, command[0])
    proc.args = command
    return proc


async def spawn(
    args: Sequence[str | os.PathLike[str]],
    *,
    new_group: bool = True,
    die_with_parent: bool = True,
    **kw: Any,
) -> asyncio.subprocess.Process:
    """:func:`popen` for asyncio: ``asyncio.create_subprocess_exec(*args, **kw)``. The fork
    happens in the event loop's thread, so the death signal follows that thread."""
    import asyncio

    command, argv, options, status = _prepare(args, new_group, die_with_parent, kw)
    if status is None:
        return await asyncio.create_subprocess_exec(*argv, **options)
    read_fd, write_fd = status
    try:
        try:
            proc = await asyncio.create_subprocess_exec(*argv, **options)
        finally:
            os.close(write_fd)
        try:
            report = await _read_to_end_async(read_fd)
        except BaseException:  # cancelled while it starts: leave nothing behind
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            raise
    finally:
        os.close(read_fd)
    if report:
        await proc.wait()
        raise _exec_error(report, command[0])
    return proc


async def _read_to_end_async(fd: int) -> bytes:
    import asyncio

    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    chunks: list[bytes] = []
    ended: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        try:
            chunk = os.read(fd, 64)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            chunks.append(chunk)
        elif not ended.done():
            ended.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await ended
    finally:
        loop.remove_reader(fd)
    return b"".join(chunks)


def has_exited(pid: int) -> bool:
    """Whether our child ``pid`` has exited, without reaping it: its zombie keeps the pid, and
    so its group id, ours. ``ChildProcessError`` when it is not (or no longer) our child:
    reaped elsewhere, its pid may already be someone else's."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def signal_group(pgid: int, sig: int, *, leader: bool = False) -> None:
    """Send ``sig`` to process group ``pgid``; nothing if it is empty. With ``leader``, when
    there is no such group yet (a forked child that has not called ``setsid``), signal the
    process ``pgid`` itself: only for a child of ours that is not reaped."""
    if pgid <= 0:  # 0 and -1 would mean our own group, or every process we may signal
        return
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        if leader:
            with contextlib.suppress(OSError):
                os.kill(pgid, sig)
    except PermissionError:
        pass


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``signal 64`` for a number this system has no name for. The one
    decoder for every exit planaria describes (a worker's, a node's, a script's)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class ProcStat(NamedTuple):
    """What this package reads of a process's ``/proc/PID/stat``."""

    state: str
    """``R`` running, ``S`` sleeping, ``T`` stopped, ``Z`` a zombie, ...: proc(5)."""
    ppid: int
    pgrp: int
    start_time: str
    """When it started, in clock ticks since boot: with the pid, it names one process."""

    @property
    def exited(self) -> bool:
        """It has exited (a zombie, or dead): it only waits to be reaped."""
        return self.state in ("Z", "X", "x")


def proc_stat(pid: int | str) -> ProcStat | None:
    """Process ``pid`` as ``/proc`` tells it; None when there is no such process (or no
    /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses: count from its end.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if len(fields) < 20:
        return None
    return ProcStat(fields[0].decode(), int(fields[1]), int(fields[2]), fields[19].decode())


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (running, sleeping or stopped)."""
    stat = proc_stat(pid)
    return stat is not None and not stat.exited


def processes() -> Iterator[tuple[int, ProcStat]]:
    """Every process of this machine that has not exited, with its stat (one scan of
    ``/proc``; one that exits meanwhile may be left out). Nothing without /proc."""
    try:
        entries = os.scandir("/proc")
    except OSError:
        return
    with entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            stat = proc_stat(entry.name)
            if stat is not None and not stat.exited:
                yield int(entry.name), stat


def group_members(pgid: int) -> list[int]:
    """The pids of process group ``pgid`` that have not exited, in order."""
    return sorted(pid for pid, stat in processes() if stat.pgrp == pgid)


def live_groups(pgids: Iterable[int]) -> set[int]:
    """Which of ``pgids`` still have a live member; a zombie is not live (it only waits to be
    reaped). From /proc; without it, a group of zombies counts as live."""
    candidates: set[int] = set()
    for pgid in pgids:
        if pgid <= 0:
            continue
        try:
            os.killpg(pgid, 0)  # the cheap, common answer: nobody left at all
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        candidates.add(pgid)
    if not candidates or not os.path.isdir("/proc"):
        return candidates
    live: set[int] = set()
    for _, stat in processes():
        if stat.pgrp in candidates:
            live.add(stat.pgrp)
            if live == candidates:
                break
    return live


def kill_groups(pgids: Iterable[int], grace: float, *, kill_wait: float = KILL_WAIT) -> set[int]:
    """End whole process groups: SIGTERM (and SIGCONT, so that a stopped process acts on it),
    up to ``grace`` seconds for them to empty, then SIGKILL; returns once they are empty, or
    with the groups that still have a live member after ``kill_wait`` more seconds.

    Call it while each leader is unreaped, or some member lives (see the module docstring).
    One grace for all the groups, not one each."""
    groups = {pgid for pgid in pgids if pgid > 0}
    if grace > 0:
        for pgid in groups:
            signal_group(pgid, signal.SIGTERM)
            signal_group(pgid, signal.SIGCONT)
        _wait_empty(groups, grace, _TERM_POLL, None)
    return _wait_empty(groups, kill_wait, _KILL_POLL, signal.SIGKILL)


def kill_group(pgid: int, grace: float, *, kill_wait: float = KILL_WAIT) -> bool:
    """:func:`kill_groups` for one group; whether it is empty now."""
    return not kill_groups([pgid], grace, kill_wait=kill_wait)


def _wait_empty(groups: set[int], timeout: float, interval: float, sig: int | None) -> set[int]:
    """Wait until none of ``groups`` has a live member, at most ``timeout`` seconds; with
    ``sig``, signal the live ones on every look (a member forked meanwhile gets it too)."""
    deadline = time.monotonic() + timeout
    left = set(groups)
    while True:
        if sig is not None:
            for pgid in left:
                signal_group(pgid, sig)
        left = live_groups(left)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(interval)


def wait_readable(fds: Sequence[int], timeout: float) -> None:
    """Sleep until one of ``fds`` (pidfds: readable once their process exits) is readable, at
    most ``timeout`` seconds, rounded down to the millisecond so that a caller looping to a
    deadline never waits past it."""
    import select  # here, not at the top: the zygote loads this module with nothing imported

    if not fds:
        time.sleep(max(0.0, timeout))
        return
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    poller.poll(max(0, int(timeout * 1000)))
