"""Starting, watching and stopping the user's worker processes.

Every worker runs in its own session (stopping it kills its whole process group, e.g. its
dataloader processes too), with PR_SET_PDEATHSIG=SIGKILL (it dies with its parent, even when the
agent is SIGKILLed; set as :mod:`planaria.process` says), stdin from /dev/null and stdout+stderr
into a pipe that the launcher copies into its log file, capped and rotated
(:mod:`planaria.agent.worker_logs`). A zygote's worker opens its pipe by name (a FIFO in a
private directory of the launcher's), as it would open a file.

What leaves the group (a data loader or a helper server that called ``setsid``, a daemon that
double-forked) is found by the launcher's marker (:mod:`planaria.leftovers`): every worker, and
the zygote that forks them, carries it in its environment, and so does everything they start.
Once a group is stopped, and before the next one starts, whatever still carries it (but the
zygote) is killed: a restart or the job's end leaves no process of the workers behind.

A plain Python command (``python [-u -O -B] script.py ...``, ``-m module``, ``-c code``) run by
this very interpreter goes through a warm zygote (:mod:`planaria.agent.zygote`): one
pre-imported interpreter per launcher that forks the workers, so that a restart pays neither
interpreter start-up nor ``import torch``. Any other command is exec'd.

Forks happen in the event loop's thread, and PDEATHSIG fires when the forking *thread* exits:
the loop must run in a thread that lives as long as the agent (``asyncio.run`` in main).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planaria import leftovers, process
from planaria.agent import zygote as _zygote
from planaria.agent.console import ConsoleBuffer
from planaria.agent.program import (
    PythonProgram,
    is_python,
    parse_python_command,
    same_interpreter,
)
from planaria.agent.worker_logs import LogLimits, LogPump, Source
from planaria.capacity import shortfall
from planaria.errors import PlanariaError
from planaria.log import get_logger

log = get_logger("agent.workers")

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


class _Worker:
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
        workers: Sequence[_Worker],
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
        await _terminate(running, self.stop_grace)
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


async def _terminate(workers: Sequence[_Worker], grace: float) -> None:
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


class _ZygoteClient:
    """The agent's end of one zygote process."""

    def __init__(self, launcher: WorkerLauncher, program: PythonProgram) -> None:
        self.launcher, self.program = launcher, program
        self.proc: asyncio.subprocess.Process | None = None
        self.alive = False
        self.info: dict[str, Any] = {}
        self._sock: socket.socket | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.Future[None] | None = None
        self._ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending: dict[int, tuple[_Worker, asyncio.Future[None]]] = {}
        self._running: dict[int, _Worker] = {}  # request id -> worker
        self._ids = itertools.count(1)

    async def start(self, timeout: float) -> None:
        lau, p = self.launcher, self.program
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        program = {"kind": p.kind, "target": p.target, "args": list(p.args)}
        config = {"parent": os.getpid(), "fd": theirs.fileno(), "preload": list(lau.preload)}
        config.update(program=program, cwd=str(lau.cwd), title=" ".join(lau.command))
        zygote_file = str(Path(_zygote.__file__).resolve())
        argv = [sys.executable, *p.flags, "-c", _zygote.BOOTSTRAP, zygote_file, json.dumps(config)]
        self._sock = ours  # close() closes it if we fail or are cancelled before the end
        try:
            # It sets its own death signal (it is told the parent's pid): no trampoline.
            self.proc = await process.spawn(
                argv, die_with_parent=False, stdin=subprocess.DEVNULL, stdout=2, cwd=lau.cwd,
                env=lau.base_env, pass_fds=(theirs.fileno(),),
            )  # fmt: skip
        finally:
            theirs.close()
        self.alive = True
        reader, self._writer = await asyncio.open_unix_connection(sock=ours, limit=1 << 20)
        self._reader = asyncio.ensure_future(self._read(reader))
        self.info = await asyncio.wait_for(asyncio.shield(self._ready), timeout)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                msg = json.loads(line)
                kind, rid = msg.get("type"), msg.get("id")
                if kind == "ready" and not self._ready.done():
                    self._ready.set_result(msg)
                elif kind in ("spawned", "error") and rid in self._pending:
                    worker, fut = self._pending.pop(rid)
                    if kind == "error":
                        fut.set_exception(WorkerStartRefused(f"cannot start: {msg['error']}"))
                        continue
                    worker.pid = msg["pid"]
                    self._running[rid] = worker
                    fut.set_result(None)
                elif kind == "exited" and (gone := self._running.pop(rid, None)):
                    gone.exited(msg["exitcode"], msg["signal"], clean_group=False)
        except (OSError, ValueError) as exc:
            log.error("lost the zygote's channel", error=str(exc))
        finally:
            self._lost()

    def _lost(self) -> None:
        self.alive = False
        err = WorkerSpawnError("the zygote exited")
        futures: list[asyncio.Future[Any]] = [self._ready]
        for fut in futures + [fut for _, fut in self._pending.values()]:
            if not fut.done():
                fut.set_exception(err)
        self._ready.exception()  # retrieved: start() may be gone (cancelled)
        self._pending.clear()
        for worker in self._running.values():  # PDEATHSIG has SIGKILLed them
            worker.signal(signal.SIGKILL)
            worker.exited(None, signal.SIGKILL, clean_group=True)
        self._running.clear()
        self.launcher._zygote_lost(self)

    async def spawn(self, specs: Sequence[WorkerSpec]) -> list[_Worker]:
        if not self.alive or self._writer is None:
            raise WorkerSpawnError("the zygote is not running")
        loop, workers, futures = asyncio.get_running_loop(), [], []
        pump, fifos, reads, holds = self.launcher.pump(), [], [], []
        mains: list[Path] = []
        errs: list[Path | None] = []
        try:  # every log opens before any worker starts
            for spec in specs:
                rid, sources = next(self._ids), spec.sources()
                pair = sources if isinstance(sources, tuple) else (sources,)
                names = [str(rid), f"{rid}-stderr"][: len(pair)]
                header = spec.header
                for name, source in zip(names, pair, strict=True):
                    fifos.append(self.launcher.fifo(name))
                    read = os.open(fifos[-1], os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                    # Held open until the worker has its own: no end of file before it writes.
                    holds.append(os.open(fifos[-1], os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
                    pump.add(read, spec.log_path, source, header)
                    header = b""
                    reads.append(read)
                mains.append(fifos[-len(pair)])
                errs.append(fifos[-1] if len(pair) == 2 else None)
        except OSError as exc:
            for hold in holds:
                os.close(hold)
            self.launcher.fifos_done()
            for read in reads:
                pump.discard(read)
            for fifo in fifos:
                with contextlib.suppress(OSError):
                    os.unlink(fifo)
            raise WorkerSpawnError(f"cannot open the workers' log: {exc}") from exc
        for spec, fifo, err in zip(specs, mains, errs, strict=True):
            rid, worker, fut = int(fifo.name), _Worker(spec, pump), loop.create_future()
            self._pending[rid] = (worker, fut)
            workers.append(worker)
            futures.append(fut)
            req = {"op": "spawn", "id": rid, "local_rank": spec.local_rank, "env": spec.env}
            req["log_path"] = str(fifo)
            if err is not None:
                req["err_path"] = str(err)
            self._writer.write(json.dumps(req).encode() + b"\n")
        with contextlib.suppress(OSError):  # if the zygote died, _lost() fails the futures
            await self._writer.drain()
        try:
            results = await asyncio.gather(*futures, return_exceptions=True)
        finally:
            for fifo in fifos:  # opened by now (or never will be): its name is not needed
                with contextlib.suppress(OSError):
                    os.unlink(fifo)
            for hold in holds:
                os.close(hold)
            self.launcher.fifos_done()
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await _terminate([w for w in workers if w.pid > 0], 0.0)
            raise errors[0]
        return workers

    async def close(self) -> None:
        if self.proc is not None and not self._ready.done():
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()  # still preloading: it has no children yet
        if self._writer is not None:
            with contextlib.suppress(OSError, RuntimeError):
                self._writer.write(b'{"op":"shutdown"}\n')
                await self._writer.drain()
            self._writer.close()
        elif self._sock is not None:
            self._sock.close()
        if self.proc is not None:
            try:
                await asyncio.wait_for(self.proc.wait(), 5.0)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        if self._reader is not None:
            await self._reader
        self.alive = False


class WorkerLauncher:
    """Starts groups of workers for one command; owns the warm zygote, if any."""

    def __init__(
        self,
        command: Sequence[str],
        cwd: Path,
        base_env: Mapping[str, str],
        preload: Sequence[str] = ("torch",),
        stop_grace: float = 3.0,
        *,
        use_zygote: bool = True,
        start_timeout: float = 120.0,
        log_limits: LogLimits | None = None,
        console: ConsoleBuffer | None = None,
    ) -> None:
        if not command:
            raise ValueError("the worker command is empty")
        self.marker = leftovers.new_marker()
        """Carried by the workers, the zygote and all they start: see the module docstring."""
        self.command, self.cwd = tuple(command), Path(cwd)
        self.base_env = leftovers.marked(base_env, self.marker)
        self.preload, self.stop_grace, self.start_timeout = (
            tuple(preload),
            stop_grace,
            start_timeout,
        )
        self.program = parse_python_command(self.command)
        self.cold_reason: str | None = None  # why spawns do not go through a zygote
        if self.program is None:
            self.cold_reason = "not a plain Python command"
        elif not use_zygote:
            self.cold_reason = "the zygote is disabled"
        elif not same_interpreter(self.program.interpreter, self.cwd, self.base_env):
            self.cold_reason = f"{self.program.interpreter!r} is not {sys.executable}"
        self.preloaded: list[str] = []
        self.preload_failures: dict[str, str] = {}
        self._zygote: _ZygoteClient | None = None
        self._starting: asyncio.Future[None] | None = None
        self._groups: list[WorkerGroup] = []
        self._closing: asyncio.Future[None] | None = None
        self._swept = True  # no group ran since the last sweep
        self._sweeping = asyncio.Lock()
        self.log_limits = log_limits or LogLimits()
        self.console = console
        """Where lines for the console go (:mod:`planaria.agent.console`); None: nowhere."""
        self._pump: LogPump | None = None
        self._fifos: Path | None = None

    def pump(self) -> LogPump:
        """The thread that copies the workers' output into their logs (started once)."""
        if self._pump is None:
            self._pump = LogPump(self.log_limits, self.console)
        return self._pump

    def fifo(self, name: object) -> Path:
        """A new FIFO, in the launcher's private directory, for a zygote's worker to write to."""
        if self._fifos is None:
            self._fifos = Path(tempfile.mkdtemp(prefix="planaria-output-"))
        path = self._fifos / str(name)
        os.mkfifo(path, 0o600)
        return path

    def fifos_done(self) -> None:
        """The FIFOs' names are not needed once their workers hold them: the directory goes
        (only an agent killed mid-spawn leaves one behind)."""
        if self._fifos is not None:
            shutil.rmtree(self._fifos, ignore_errors=True)
            self._fifos = None

    @property
    def warm(self) -> bool:
        """Whether spawns go through the zygote."""
        return self._zygote is not None and self._zygote.alive

    @property
    def zygote_pid(self) -> int | None:
        proc = self._zygote.proc if self._zygote is not None and self.warm else None
        return proc.pid if proc is not None else None

    async def start(self) -> None:
        """Start the warm zygote now if the command is a Python program (else do nothing)."""
        if self.cold_reason is not None or self._closing is not None or self.warm:
            return
        if self._starting is None or self._starting.done():
            self._starting = asyncio.ensure_future(self._start_zygote())
        await asyncio.shield(self._starting)

    async def _start_zygote(self) -> None:
        assert self.program is not None
        if self._zygote is not None:  # a dead one
            await self._zygote.close()
        zygote, started = _ZygoteClient(self, self.program), time.monotonic()
        try:
            await zygote.start(self.start_timeout)
            if zygote.info.get("cuda_initialized"):
                raise WorkerSpawnError("a preloaded module initialized CUDA: forks cannot use it")
        except Exception as exc:
            await zygote.close()
            self.cold_reason = f"the zygote failed: {exc or type(exc).__name__}"
            log.warning("workers will start cold", reason=self.cold_reason)
            return
        except BaseException:  # cancelled: leave nothing behind
            await asyncio.shield(zygote.close())
            raise
        self._zygote, info = zygote, zygote.info
        self.preloaded, self.preload_failures = info["preloaded"], info["failed"]
        for name, why in self.preload_failures.items():
            log.warning("cannot preload module", module=name, error=why)
        seconds = round(time.monotonic() - started, 3)
        log.info(
            "zygote ready",
            pid=info["pid"],
            preloaded=self.preloaded,
            seconds=seconds,
            threads=info["threads"],
        )

    def _zygote_lost(self, zygote: _ZygoteClient) -> None:
        if self._closing is None and zygote is self._zygote:
            log.warning("the zygote exited; the next spawn starts a new one")

    async def spawn(self, specs: Sequence[WorkerSpec]) -> WorkerGroup:
        if self._closing is not None:
            raise WorkerSpawnError("the launcher is closed")
        ranks = [s.local_rank for s in specs]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"duplicate local ranks in {ranks}")
        why = shortfall(len(specs), len(specs))
        if why is not None:  # refused before the first fork, not after thousands
            raise WorkerStartRefused(
                f"cannot start {len(specs)} workers on this node: {why}; lower job.procs_per_node"
            )
        for spec in specs:
            try:
                spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise WorkerSpawnError(f"cannot create the log directory: {exc}") from exc
        specs = [dataclasses.replace(s, env=leftovers.marked(s.env, self.marker)) for s in specs]
        if self.cold_reason is None and not self.warm:
            await self.start()
        async with self._sweeping:  # a sweep never runs while workers start
            if not self._swept and not any(g.running for g in self._groups):
                await self._sweep_now()
            self._swept = False
            if self._zygote is not None and self.warm:
                workers = await self._zygote.spawn(specs)
            else:
                workers = await self._spawn_exec(specs)
        group = WorkerGroup(workers, self.stop_grace, self.sweep)
        self._groups = [g for g in self._groups if g.running] + [group]
        return group

    async def sweep(self) -> None:
        """Kill what the workers left running outside their process groups (it carries the
        launcher's marker), unless a group still runs; what it found is logged."""
        async with self._sweeping:
            if not any(g.running for g in self._groups):
                await self._sweep_now()

    async def _sweep_now(self) -> None:
        zygote = self.zygote_pid
        exclude = () if zygote is None else (zygote,)
        found = await asyncio.to_thread(leftovers.kill_survivors, self.marker, exclude=exclude)
        self._swept = True
        if found:
            log.warning(
                "killed processes the workers left running",
                count=len(found),
                processes=[str(s) for s in found[:20]],
            )

    async def _spawn_exec(self, specs: Sequence[WorkerSpec]) -> list[_Worker]:
        argv = list(self.command)
        if is_python(argv[0]) and not (self.program and any("u" in f for f in self.program.flags)):
            argv.insert(1, "-u")  # unbuffered: the log stays current
        workers: list[_Worker] = []
        pump = self.pump()
        try:
            for spec in specs:
                sources = spec.sources()
                if isinstance(sources, tuple):  # one stream shows, the other does not
                    fd = pump.pipe(spec.log_path, sources[0], spec.header)
                    try:
                        err = pump.pipe(spec.log_path, sources[1])
                    except OSError:
                        os.close(fd)
                        raise
                else:
                    fd, err = pump.pipe(spec.log_path, sources, spec.header), -1
                worker = _Worker(spec, pump)  # its output starts after the header
                try:  # this forks in the event loop's thread: see the module's docstring
                    proc = await process.spawn(
                        argv, stdin=subprocess.DEVNULL, stdout=fd,
                        stderr=subprocess.STDOUT if err < 0 else err, cwd=self.cwd, env=spec.env,
                    )  # fmt: skip
                finally:
                    os.close(fd)
                    if err >= 0:
                        os.close(err)
                worker.pid = proc.pid
                worker.watcher = asyncio.ensure_future(self._watch(worker, proc))
                workers.append(worker)
        except (OSError, subprocess.SubprocessError) as exc:
            await _terminate(workers, 0.0)
            raise WorkerStartRefused(f"cannot start {argv[0]!r}: {exc}") from exc
        return workers

    @staticmethod
    async def _watch(worker: _Worker, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        worker.exited(code if code >= 0 else None, -code if code < 0 else None, clean_group=True)

    async def close(self) -> None:
        """Stop every group still running, then the zygote. Idempotent."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
            with contextlib.suppress(BaseException):
                await self._starting
        stops = await asyncio.gather(*(g.stop() for g in self._groups), return_exceptions=True)
        self._groups.clear()
        if self._zygote is not None:
            await self._zygote.close()
        await self.sweep()  # the zygote is gone: what it held goes too
        if self._pump is not None:
            await asyncio.to_thread(self._pump.close)
        self.fifos_done()
        for result in stops:
            if isinstance(result, BaseException):
                raise result
