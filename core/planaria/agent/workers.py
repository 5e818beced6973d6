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
this very interpreter goes through a warm zygote (:mod:`planaria.agent.zygote`, driven by
:mod:`planaria.agent.zygote_client`): one pre-imported interpreter per launcher that forks the
workers, so that a restart pays neither interpreter start-up nor ``import torch``. Any other
command is exec'd. Either way the workers come back as a
:class:`~planaria.agent.worker_group.WorkerGroup`, which watches and stops them; its types are
importable from here too.

Forks happen in the event loop's thread, and PDEATHSIG fires when the forking *thread* exits:
the loop must run in a thread that lives as long as the agent (``asyncio.run`` in main).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from planaria import leftovers, process
from planaria.agent.console import ConsoleBuffer
from planaria.agent.program import (
    is_python,
    parse_python_command,
    same_interpreter,
)
from planaria.agent.worker_group import KILL_TIMEOUT as KILL_TIMEOUT
from planaria.agent.worker_group import GroupResult as GroupResult
from planaria.agent.worker_group import Worker, terminate
from planaria.agent.worker_group import WorkerExit as WorkerExit
from planaria.agent.worker_group import WorkerGroup as WorkerGroup
from planaria.agent.worker_group import WorkerSpawnError as WorkerSpawnError
from planaria.agent.worker_group import WorkerSpec as WorkerSpec
from planaria.agent.worker_group import WorkerStartRefused as WorkerStartRefused
from planaria.agent.worker_group import WorkerStopError as WorkerStopError
from planaria.agent.worker_group import read_log_tail as read_log_tail
from planaria.agent.worker_logs import LogLimits, LogPump
from planaria.agent.zygote_client import ZygoteClient
from planaria.capacity import shortfall
from planaria.log import get_logger

log = get_logger("agent.workers")


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
        self._zygote: ZygoteClient | None = None
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
        zygote = ZygoteClient(self, self.program, self._zygote_lost)
        started = time.monotonic()
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

    def _zygote_lost(self, zygote: ZygoteClient) -> None:
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

    async def _spawn_exec(self, specs: Sequence[WorkerSpec]) -> list[Worker]:
        argv = list(self.command)
        if is_python(argv[0]) and not (self.program and any("u" in f for f in self.program.flags)):
            argv.insert(1, "-u")  # unbuffered: the log stays current
        workers: list[Worker] = []
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
                worker = Worker(spec, pump)  # its output starts after the header
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
            await terminate(workers, 0.0)
            raise WorkerStartRefused(f"cannot start {argv[0]!r}: {exc}") from exc
        return workers

    @staticmethod
    async def _watch(worker: Worker, proc: asyncio.subprocess.Process) -> None:
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
