"""``python -m planaria_slurm.step COMMAND...``: what each node's job step runs, around the
agent, so that nothing of the node outlives its step.

Slurm ends a step by signalling the processes it tracks. Without cgroups
(``proctrack/linuxproc``) it tracks them by parentage, and a process whose parent died first
(a worker's child after SIGTERM ended the worker) is re-parented away and escapes, holding the
step's output open, so that srun never returns. This wrapper is a child subreaper: orphans of
the node come back to it, and when the command ends it kills every one left, then exits with
the command's status (128+N for a signal N, as srun reports). It ignores SIGTERM itself (Slurm
sends it to the whole step), so that it lives to do that; SIGKILL of the step still takes it
and everything below it at once.

Standard library only: it starts in a few milliseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _kill_rest() -> None:
    """SIGKILL every descendant (orphans come back to us) and reap them all."""
    me = os.getpid()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        pending = [me]
        found = []
        while pending:
            for child in _children(pending.pop()):
                found.append(child)
                pending.append(child)
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return  # no child of ours left, alive or dead
        time.sleep(0.01)


def main(argv: list[str]) -> int:
    if not argv:
        sys.stderr.write("usage: python -m planaria_slurm.step COMMAND [ARG ...]\n")
        return 2
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        # SIGTERM back at its default in the command: the wrapper alone ignores it.
        child = subprocess.Popen(argv, restore_signals=True, preexec_fn=_default_term)
    except OSError as exc:
        sys.stderr.write(f"planaria_slurm.step: cannot start {argv[0]}: {exc}\n")
        return 127
    code = child.wait()
    _kill_rest()
    return code if code >= 0 else 128 - code


def _default_term() -> None:  # runs in the child, single-threaded parent: safe
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
