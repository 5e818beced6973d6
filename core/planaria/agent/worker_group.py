"""A group of the user's worker processes, as the agent holds them.

What a worker is started with (:class:`WorkerSpec`), how it ended (:class:`WorkerExit`, with the
tail of its own log), and how a group is watched and stopped: :class:`WorkerGroup` returns at
the first failure and stops the rest, each worker's whole process group, SIGTERM then SIGKILL
(:func:`terminate`). Starting workers, cold or through the zygote, is
:mod:`planaria.agent.workers`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from planaria import process
from planaria.agent.worker_logs import LogPump, Source
from planaria.errors import PlanariaError

KILL_TIMEOUT = 30.0  # a process still there this long after SIGKILL is stuck in the kernel
_order = itertools.count()


class WorkerSpawnError(PlanariaError):
    """Workers could not be started (bad command, unwritable log, fork failure ...)."""


class WorkerStartRefused(WorkerSpawnError):
    """The system refused the workers as the job asks for them (no such program, an
    environment the kernel rejects, more workers than the node has room for): a restart or
    another node would fail the same way. A zygote that died is not this: that is the node's."""


class WorkerStopError(PlanariaError):
    """Workers survived SIGKILL: stuck in the kernel (e.g. in a hung device driver)."""


@dataclass(frozen=True)
class WorkerSpec:
    local_rank: int
    env: dict[str, str]  # the COMPLETE environment of the worker
    log_path: Path  # stdout+stderr are appended here (parents created, file mode 0600)
    rank: int = -1
    """The global rank, which prefixes its console lines; -1: the local rank."""
    console: int = 0
    """Streams shown on the console: 1 stdout, 2 stderr, 3 both (:mod:`planaria.agent.console`)."""
    header: bytes = b""
    """Written into the log before the worker's output (a restart's mark)."""

    def sources(self) -> tuple[Source | None, Source | None] | Source | None:
        """The console sources of its pipes: one for a shared pipe (both streams go the same
        way), or a pair (stdout's, stderr's) when only one of them shows."""
        rank = self.rank if self.rank >= 0 else self.local_rank
        if self.console == 3:
            return Source(rank)
        if self.console == 0:
            return None
        return (
            Source(rank, "stdout") if self.console & 1 else None,
            Source(rank, "stderr") if self.console & 2 else None,
        )


@dataclass(frozen=True)
class WorkerExit:
    local_rank: int
    pid: int
    exitcode: int | None  # None if killed by a signal
    signal: int | None  # the signal number if killed by a signal
    time: float  # time.time() when the exit was seen
    log_tail: str  # the last lines (<= 40 lines, <= 8 KiB) of its log
    stopped: bool = False  # the agent had asked it to stop (stop(), or a sibling failed)
    log_path: str = ""  # the log that holds its output

    @property
    def ok(self) -> bool:
        return self.exitcode == 0

    def describe(self) -> str:
        if self.signal is None:
            return f"exit code {self.exitcode}"
        return f"killed by {process.signal_name(self.signal)}"


@dataclass(frozen=True)
class GroupResult:
    succeeded: bool  # all workers exited 0 (and none was stopped)
    first_failure: WorkerExit | None  # the first worker that failed by itself (by time seen)
    exits: list[WorkerExit]  # every worker's exit in the order seen, incl. stopped siblings
    stopped: bool = False  # stop() was called before any worker failed


def read_log_tail(path: Path, max_lines: int = 40, max_bytes: int = 8192, since: int = 0) -> str:
    """The last whole lines of a log, within both limits, written after offset ``since`` (a
    worker's own output in a log its predecessors appended to); "" if it cannot be read."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            since = since if since <= end else 0  # the log was replaced meanwhile
            start = max(since, end - max_bytes - 1)
            f.seek(start)
            data = f.read()
    except OSError:
        return ""
    if start > since:  # drop the first line: it may be partial
        data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""
    lines = data.decode("utf-8", "replace").splitlines()[-max_lines:]
    while lines and len("\n".join(lines).encode()) > max_bytes:
        lines.pop(0)
    return "\n".join(lines)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class Worker:
    """One worker process as the agent holds it: its exit is :attr:`future`'s result."""

    def __init__(self, spec: WorkerSpec, pump: LogPump | None = None) -> None:
        self.spec, self.pid, self.stopping, self.order = spec, 0, False, 0
        self.pump = pump
        self.log_start = _size(spec.log_path)
        """Where this worker's output begins in its log: the tail of a failure is its own,
        never a traceback of the worker that failed in the previous round."""
        self.future: asyncio.Future[WorkerExit] = asyncio.get_running_loop().create_future()
        self.watcher: asyncio.Future[None] | None = None

    @property
    def done(self) -> bool:
        return self.future.done()

    def signal(self, sig: int, group: bool = True) -> None:
        if self.done or self.pid <= 0:
            return
        if group:
            process.signal_group(self.pid, sig, leader=True)
        else:
            with contextlib.suppress(OSError):
                os.kill(self.pid, sig)

    def exited(self, exitcode: int | None, sig: int | None, clean_group: bool) -> None:
        if self.done:
            return
        if clean_group:  # kill what it left behind in its process group
            process.signal_group(self.pid, signal.SIGKILL)
        self.order = next(_order)
        if self.pump is not None:  # what it wrote last is in its log before the tail is read
            self.pump.drain(self.spec.log_path)
        tail = read_log_tail(self.spec.log_path, since=self.log_start)
        rank, stopped = self.spec.local_rank, self.stopping
        self.future.set_result(
            WorkerExit(
                rank, self.pid, exitcode, sig, time.time(), tail, stopped, str(self.spec.log_path)
            )
        )


class WorkerGroup:
    """The workers of one spawn. ``wait()`` returns at the first failure, stopping the rest."""

    def __init__(
        self,
        workers: Sequence[Worker],
        stop_grace: float,
        sweep: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._workers = {w.spec.local_rank: w for w in workers}
        self.pids: dict[int, int] = {w.spec.local_rank: w.pid for w in workers}
        self.stop_grace = stop_grace
        self._sweep = sweep
        self._wait_task: asyncio.Future[GroupResult] | None = None
        self._stop_task: asyncio.Future[list[WorkerExit]] | None = None

    @property
    def running(self) -> bool:
        return any(not w.done for w in self._workers.values())

    async def wait(self) -> GroupResult:
        if self._wait_task is None:
            self._wait_task = asyncio.ensure_future(self._wait())
        return await asyncio.shield(self._wait_task)

    async def _wait(self) -> GroupResult:
        pending = {w.future for w in self._workers.values()}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(not f.result().ok for f in done):
                break
        if pending:
            await self.stop()
        exits = [w.future.result() for w in sorted(self._workers.values(), key=lambda w: w.order)]
        failures = [e for e in exits if not e.ok and not e.stopped]
        stopped = any(e.stopped for e in exits)
        return GroupResult(
            succeeded=not failures and not stopped and all(e.ok for e in exits),
            first_failure=failures[0] if failures else None,
            exits=exits,
            stopped=stopped and not failures,
        )

    async def stop(self) -> list[WorkerExit]:
        """SIGTERM every running worker's process group, SIGKILL after ``stop_grace``."""
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._stop())
        return list(await asyncio.shield(self._stop_task))

    async def _stop(self) -> list[WorkerExit]:
        running = [w for w in self._workers.values() if not w.done]
        await terminate(running, self.stop_grace)
        if self._sweep is not None:  # what left the workers' sessions goes with them
            await self._sweep()
        return [w.future.result() for w in sorted(running, key=lambda w: w.order)]

    def exits(self) -> list[WorkerExit]:
        """The exits seen so far, in the order seen."""
        done = [w for w in self._workers.values() if w.done]
        return [w.future.result() for w in sorted(done, key=lambda w: w.order)]

    def kill(self, local_rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one worker process (not its group): fault injection."""
        self._workers[local_rank].signal(sig, group=False)


async def terminate(workers: Sequence[Worker], grace: float) -> None:
    """End the workers' process groups (SIGTERM, SIGKILL after ``grace``: 0 kills at once) and
    wait until the groups are empty and every exit is seen."""
    for w in workers:
        w.stopping = True
    pgids = {w.pid for w in workers if not w.done and w.pid > 0}
    # In a thread: the exits it waits for are reported through this event loop.
    stuck = await asyncio.to_thread(process.kill_groups, pgids, grace, kill_wait=KILL_TIMEOUT)
    pending = {w.future for w in workers if not w.done}
    if pending and not stuck:  # gone: their exits are on the way (the zygote, the watcher)
        _, pending = await asyncio.wait(pending, timeout=KILL_TIMEOUT)
    if stuck or pending:
        left = sorted(stuck | {w.pid for w in workers if not w.done})
        raise WorkerStopError(f"worker processes {left} survived SIGKILL for {KILL_TIMEOUT}s")
