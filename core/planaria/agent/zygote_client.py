"""The agent's end of a warm zygote (:mod:`planaria.agent.zygote`): :class:`ZygoteClient`.

It starts the zygote, speaks its JSON-line protocol on a socket pair, and turns the answers into
the :class:`~planaria.agent.worker_group.Worker` handles a launcher hands out: a ``spawned``
gives a worker its pid, an ``exited`` its exit. Every worker's output goes through a FIFO the
worker opens by name, all opened before the first one starts. A zygote that dies fails every
spawn in flight and ends its workers (their death signal has already killed them).

The zygote itself must import nothing of ``planaria`` but :mod:`planaria.process`, hence its
client lives here, beside it, not in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from planaria import process
from planaria.agent import zygote as _zygote
from planaria.agent.program import PythonProgram
from planaria.agent.worker_group import (
    Worker,
    WorkerSpawnError,
    WorkerSpec,
    WorkerStartRefused,
    terminate,
)
from planaria.agent.worker_logs import LogPump
from planaria.log import get_logger

log = get_logger("agent.workers")


class Launcher(Protocol):
    """What a client needs of the launcher it serves
    (:class:`~planaria.agent.workers.WorkerLauncher`)."""

    @property
    def command(self) -> Sequence[str]: ...
    @property
    def cwd(self) -> Path: ...
    @property
    def base_env(self) -> Mapping[str, str]: ...
    @property
    def preload(self) -> Sequence[str]: ...
    def pump(self) -> LogPump: ...
    def fifo(self, name: object) -> Path: ...
    def fifos_done(self) -> None: ...


class ZygoteClient:
    """The agent's end of one zygote process; ``lost`` is called once its channel ends."""

    def __init__(
        self,
        launcher: Launcher,
        program: PythonProgram,
        lost: Callable[[ZygoteClient], None],
    ) -> None:
        self.launcher, self.program = launcher, program
        self._on_lost = lost
        self.proc: asyncio.subprocess.Process | None = None
        self.alive = False
        self.info: dict[str, Any] = {}
        self._sock: socket.socket | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.Future[None] | None = None
        self._ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending: dict[int, tuple[Worker, asyncio.Future[None]]] = {}
        self._running: dict[int, Worker] = {}  # request id -> worker
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
        self._on_lost(self)

    async def spawn(self, specs: Sequence[WorkerSpec]) -> list[Worker]:
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
            rid, worker, fut = int(fifo.name), Worker(spec, pump), loop.create_future()
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
            await terminate([w for w in workers if w.pid > 0], 0.0)
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
