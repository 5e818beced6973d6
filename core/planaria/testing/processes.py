"""The processes of a job under test or under a benchmark: find them by a mark in their
environment, wait for them to go, kill them, and run a launcher in a session of its own.

A job started with ``MARK=value`` in its environment passes it to its agents, warm
interpreters, workers and their children: what carries the mark is that job's, whatever the
scheduler or launcher that started it (``planaria``, ``torchrun``, ``srun``, a Ray actor), and
nothing else on the machine is touched. Only the standard library is imported, so that a
benchmark may use this module before it knows whether planaria's own dependencies are there.
:mod:`planaria.testing.jobs` builds the tests' job harness on it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

MARK = "PLANARIA_TEST_MARK"
"""The environment variable that marks every process of a test's job."""


def environ_of(pid: int | str) -> list[bytes]:
    """The ``NAME=value`` entries of a process's environment (empty when it cannot be read:
    gone, or another user's)."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def processes_with(entries: set[bytes]) -> list[int]:
    """The live (not zombie) processes whose environment holds every one of ``entries``
    (``b"NAME=value"``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not entries <= set(environ_of(entry.name)):
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        if "State:\tZ" not in status:
            found.append(int(entry.name))
    return found


def marked_processes(mark: str) -> list[int]:
    """The live processes whose environment carries ``MARK=mark``."""
    return processes_with({f"{MARK}={mark}".encode()})


def wait_gone(mark: str, grace: float = 5.0) -> list[int]:
    """Wait up to ``grace`` seconds for every process carrying ``MARK=mark`` to exit: those
    still alive then (empty: all gone)."""
    deadline = time.monotonic() + grace
    while (left := marked_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_marked(entries: set[bytes]) -> bool:
    """SIGKILL every live process whose environment holds all of ``entries``; whether there
    was one."""
    doomed = processes_with(entries)
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return bool(doomed)


def run_group(
    command: list[str], cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in a session of its own; past ``timeout`` kill the whole session (and
    raise ``TimeoutExpired`` with the output so far), so that the workers of a hung launcher
    (torchrun's are not tied to it) do not outlive it.

    Its output goes to ``cwd/launcher.out`` and ``launcher.err``, not to pipes: a worker that
    left the session (or that a killed launcher left to init) would hold a pipe open, and
    reading it to the end would wait for that worker. What left the session is for the
    caller's sweep (:class:`planaria.leftovers.Sweeper`, or the mark)."""
    out_path, err_path = cwd / "launcher.out", cwd / "launcher.err"

    def output() -> tuple[str, str]:
        return out_path.read_text(errors="replace"), err_path.read_text(errors="replace")

    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise subprocess.TimeoutExpired(command, timeout, *output()) from exc
    return subprocess.CompletedProcess(command, proc.returncode, *output())
