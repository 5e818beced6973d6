"""A child process in its own process group, which is killed as a whole.

A health-check script may start helpers (``nvidia-smi``, a background ``sleep``), so stopping
only the script would leave them running and holding its output pipes open. The script runs as
the leader of a new session; everything it starts stays in that group unless it escapes on
purpose, and :meth:`ProcessGroup.kill` ends the whole group (:mod:`planaria.process`). It also
dies with the thread that runs the check, which waits for it: an agent killed mid-check leaves
no script behind.

The leader is not reaped until the group has been killed: while it is a zombie its pid, which is
the group id, cannot be given to an unrelated process, so ``killpg`` never hits a stranger.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from planaria import process

STDOUT_LIMIT = 1 << 20
"""Bytes of stdout kept; the protocol needs one short line per device."""

STDERR_TAIL = 64 << 10
"""Bytes of stderr kept, from the end: errors quote its last lines."""

DRAIN_TIMEOUT = 2.0
"""How long to wait for the pipes to close once the group is dead. Only a process that left the
group (``setsid``) can still hold them; we stop reading rather than hang."""

_CHUNK = 1 << 16


@dataclass(frozen=True)
class Outcome:
    """What a finished script left: its exit status and its output."""

    returncode: int
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool


class _Reader:
    """Drains one pipe in a thread, keeping the head (stdout) or the tail (stderr)."""

    def __init__(self, pipe: IO[bytes], limit: int, keep_tail: bool) -> None:
        self._pipe = pipe
        self._limit = limit
        self._keep_tail = keep_tail
        self._data = bytearray()
        self.truncated = False
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        with self._pipe:
            fd = self._pipe.fileno()
            while chunk := os.read(fd, _CHUNK):
                self._data += chunk
                if len(self._data) > self._limit:
                    self.truncated = True
                    if self._keep_tail:
                        del self._data[: len(self._data) - self._limit]
                    else:
                        del self._data[self._limit :]

    def join(self, deadline: float) -> bytes:
        """What was read by ``deadline`` (a ``time.monotonic()`` value), or at end of file."""
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return bytes(self._data)


class ProcessGroup:
    """``[argv]`` started as a new session; wait for it, kill its group, collect its output."""

    def __init__(
        self, argv: Sequence[str], cwd: Path, env: Mapping[str, str], kill_grace: float
    ) -> None:
        self._argv = list(argv)
        self._cwd = cwd
        self._env = dict(env)
        self._kill_grace = kill_grace
        self._lock = threading.Lock()
        self._exited = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._reaped = False

    def start(self) -> None:
        """Start the process; raises ``OSError`` or ``ValueError`` when it cannot be."""
        proc = process.popen(
            self._argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=self._cwd,
            env=self._env,
        )
        assert proc.stdout is not None and proc.stderr is not None
        self._proc = proc
        self._stdout = _Reader(proc.stdout, STDOUT_LIMIT, keep_tail=False)
        self._stderr = _Reader(proc.stderr, STDERR_TAIL, keep_tail=True)
        threading.Thread(target=self._watch, args=(proc.pid,), daemon=True).start()

    def _watch(self, pid: int) -> None:
        # WNOWAIT: notice the exit but leave the zombie, which keeps the group id ours.
        # ChildProcessError: already reaped (the host program ignores SIGCHLD); nothing to hold.
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        self._exited.set()

    def wait(self, timeout: float | None) -> bool:
        """Wait for the leader to exit; ``False`` if it is still running after ``timeout``."""
        return self._exited.wait(None if timeout is None else min(timeout, threading.TIMEOUT_MAX))

    def kill(self) -> None:
        """SIGTERM the whole group, give it ``kill_grace`` to exit, then SIGKILL it.

        Safe to call from any thread, more than once, and after :meth:`finish`.
        """
        with self._lock:
            if self._proc is None or self._reaped:
                return
            # The leader is not reaped before finish(): its group id stays ours meanwhile.
            process.kill_group(self._proc.pid, self._kill_grace)

    def finish(self) -> Outcome:
        """Kill what the leader left in its group, reap the leader and collect the output.

        Call once the leader has exited (after :meth:`wait` returned ``True`` or :meth:`kill`).
        """
        proc = self._proc
        assert proc is not None, "finish() before start()"
        with self._lock:
            if not self._reaped:
                process.signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
                self._reaped = True
        deadline = time.monotonic() + DRAIN_TIMEOUT
        stdout = self._stdout.join(deadline)
        stderr = self._stderr.join(deadline)
        return Outcome(proc.returncode, stdout, stderr, self._stdout.truncated)
