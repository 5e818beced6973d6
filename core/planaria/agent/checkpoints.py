"""The agent's part of the flash checkpoint: it owns the node's shared memory and persister.

Workers' segments are named per node and local rank, so they outlive a worker and a restarted
worker finds its last steps in memory. Before each round the agent reads which steps its
segments hold (the master picks the step every rank can restore), and at a fault it can have the
persister write the agreed step. The persister is a separate process watching the agent: if the
agent dies, it finishes what it was asked to persist, removes the node's segments and exits. If
the persister dies first, the agent restarts it at once and reports it: the segments are files
and survive it, and workers reconnect to the new one and hand it again what was pending. A
persister that stops answering (stopped, or hung on its storage in the kernel) is pinged every
``checkpoint.persister_timeout`` seconds, killed when a ping goes unanswered that long, and
replaced the same way: a worker's save waits for it at most that long.

Why one module: the persister, the peer replicas' ends and the reading of what memory holds
all act on the node's one shared-memory directory, in the order of the agent's life (started
with it, told each round's part, stopped before the directory goes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planaria import process
from planaria.checkpoint import persister
from planaria.checkpoint.env import (
    GENERATION_ENV,
    KEEP_LAST_ENV,
    PERSIST_EVERY_ENV,
    PERSISTER_TIMEOUT_ENV,
    REQUIRE_RESTORE_ENV,
    RESTORE_ENV,
    SEGMENT_ENV,
    SOCKET_ENV,
    STORAGE_ENV,
)
from planaria.checkpoint.replica import ReplicaError, ReplicaSender, ReplicaServer, fetch
from planaria.checkpoint.segment import Segment, SegmentError, remove_segments
from planaria.log import get_logger
from planaria.protocol import (
    CheckpointSpec,
    MemoryHolding,
    ReplicaEndpoint,
    ReplicaFetch,
    ReplicaHolding,
)

log = get_logger("agent")

QUICK_DEATH = 10.0
"""A persister that dies within this many seconds of its start is restarted after a back-off
(1, 2, 4 ... 30 s), not at once: it would only die again."""


class NodeCheckpoints:
    """Names the node's segments, runs its persister, reads what memory holds."""

    def __init__(
        self, spec: CheckpointSpec, directory: Path, on_event: Callable[[dict[str, Any]], None]
    ) -> None:
        self.spec = spec
        self.directory = directory
        """The node's private directory in /dev/shm (:func:`planaria.shm.node_dir`)."""
        self.prefix = str(directory)
        """What the persister removes once its agent is gone: the whole directory."""
        self.socket_path = directory / "sock"
        self.on_event = on_event
        self._process: subprocess.Popen[bytes] | None = None
        self._supervisor: threading.Thread | None = None
        self._readers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._syncs: dict[str, threading.Event] = {}
        self._hung: str | None = None
        """Why the watchdog killed the persister (it stopped answering), for the event."""
        self._watchdog: threading.Thread | None = None
        self.replica_server: ReplicaServer | None = None
        self._replica_sender: ReplicaSender | None = None
        self._token = ""

    def segment(self, local_rank: int) -> Path:
        return self.directory / f"ckpt-{local_rank}"

    def worker_env(self, local_rank: int, restore: str, generation: int) -> dict[str, str]:
        return {
            GENERATION_ENV: str(generation),
            SOCKET_ENV: str(self.socket_path),
            SEGMENT_ENV: str(self.segment(local_rank)),
            RESTORE_ENV: restore,
            STORAGE_ENV: json.dumps(self.spec.storage),
            KEEP_LAST_ENV: str(self.spec.keep_last),
            PERSIST_EVERY_ENV: str(self.spec.persist_every),
            REQUIRE_RESTORE_ENV: "1" if self.spec.require_restore else "0",
            PERSISTER_TIMEOUT_ENV: repr(self.spec.persister_timeout),
        }

    # -- the persister -------------------------------------------------------------------------

    def start(self) -> None:
        self._spawn()
        self._supervisor = threading.Thread(target=self._supervise, name="persister", daemon=True)
        self._supervisor.start()
        self._watchdog = threading.Thread(target=self._watch, name="persister-ping", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        """Kill a persister that does not answer a ping within ``persister_timeout`` (the
        supervisor then starts a new one). One still starting has no socket yet: that is no
        hang; a stopped one's socket still accepts connections, and the ping times out."""
        timeout = self.spec.persister_timeout
        while not self._stopping.wait(timeout):
            with self._lock:
                proc = self._process
            if proc is None or proc.poll() is not None:
                continue
            if self._answers(timeout):
                continue
            with self._lock:
                if self._stopping.is_set() or proc is not self._process or proc.poll() is not None:
                    continue
                self._hung = f"stopped answering for {timeout:g}s (killed)"
                log.warning("checkpoint persister stopped answering; killing it", pid=proc.pid)
                proc.kill()

    def _answers(self, timeout: float) -> bool:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(timeout)
                sock.connect(str(self.socket_path))
                with sock.makefile("rb") as reader:
                    persister.ask(sock, reader, {"op": "ping"}, "pong")
        except TimeoutError:
            return False
        except (OSError, ValueError):  # not listening yet, or dying: the supervisor's case
            return True
        return True

    def _spawn(self) -> None:
        read_fd, write_fd = os.pipe()
        try:
            argv = persister.command(
                self.socket_path, self.spec.storage, self.spec.keep_last, self.prefix
            )
            # Its own session: a signal to the agent's process group must not cut a persist
            # short. It follows the agent itself (--parent), to finish a persist first.
            self._process = process.popen(
                [*argv, "--events-fd", str(write_fd)],
                die_with_parent=False,
                pass_fds=(write_fd,),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        reader = threading.Thread(
            target=self._read_events, args=(read_fd,), name="persister-events", daemon=True
        )
        reader.start()
        self._readers.append(reader)

    def _supervise(self) -> None:
        """Restart the persister whenever it dies before :meth:`stop`, and report it."""
        quick = 0
        while True:
            proc, started = self._process, time.monotonic()
            assert proc is not None
            code = proc.wait()
            if self._stopping.is_set():
                return
            with self._lock:
                why, self._hung = self._hung or _describe(code), None
            quick = quick + 1 if time.monotonic() - started < QUICK_DEATH else 0
            if self._stopping.wait(min(30.0, 2.0 ** (quick - 1)) if quick else 0.0):
                return
            with self._lock:
                if self._stopping.is_set():
                    return
                try:
                    self._spawn()
                except OSError as exc:  # tried again after the back-off
                    log.error("cannot restart the checkpoint persister", why=why, error=str(exc))
                    continue
            assert self._process is not None
            log.warning("checkpoint persister died; restarted", why=why, pid=self._process.pid)
            self.on_event({"event": "persister_restarted", "error": why})

    def _read_events(self, fd: int) -> None:
        with os.fdopen(fd, "r", encoding="utf-8", errors="replace") as stream:
            for line in stream:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                kind = event.get("event")
                if kind == "persister_ready":
                    continue  # workers retry their connection while it starts
                if kind == "synced":
                    with self._lock:
                        seen = self._syncs.get(str(event.get("token")))
                    if seen is not None:
                        seen.set()
                    continue
                self.on_event(event)

    def sync(self, timeout: float = 2.0) -> bool:
        """Wait until every event the persister wrote before now was handed to ``on_event``
        (the master must learn a step's fate before the workers' end). False if it cannot
        tell (no persister running)."""
        token = secrets.token_hex(8)
        seen = threading.Event()
        with self._lock:
            self._syncs[token] = seen
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(timeout)
                sock.connect(str(self.socket_path))
                with sock.makefile("rb") as reader:
                    persister.ask(sock, reader, {"op": "sync", "token": token}, "synced")
            return seen.wait(timeout)
        except (OSError, ValueError):
            return False
        finally:
            with self._lock:
                self._syncs.pop(token, None)

    # -- peer replicas (checkpoint.replica) ---------------------------------------------------

    def start_replicas(self, node_id: str, addr: str, token: str, procs: int) -> None:
        """Serve peers' replicas at ``addr`` and copy this node's steps to its buddy (when
        the job keeps replicas)."""
        replica = self.spec.replica
        if replica is None:
            return
        self._token = token
        self.replica_server = ReplicaServer(self.directory, token, addr)
        per_second = None if replica.max_mb_per_second is None else replica.max_mb_per_second * 1e6
        self._replica_sender = ReplicaSender(
            self.segment,
            procs,
            token,
            node_id,
            every=replica.every,
            max_bytes_per_second=per_second,
        )

    def replicas(self) -> list[ReplicaHolding]:
        return [] if self.replica_server is None else self.replica_server.holdings()

    def replica_round(self, round_: int, buddy: ReplicaEndpoint | None) -> None:
        """A round starts: take no copy from an older one, send to this round's buddy."""
        if self.replica_server is not None:
            self.replica_server.round = round_
        if self._replica_sender is not None:
            self._replica_sender.target(buddy, round_)

    async def fetch_replicas(self, fetches: list[ReplicaFetch]) -> tuple[ReplicaFetch, str] | None:
        """Copy each replica into its local rank's segment; the one that failed and why, if
        any."""
        for wanted in fetches:
            try:
                seconds = await asyncio.to_thread(
                    fetch,
                    wanted.holder,
                    self._token,
                    rank=wanted.rank,
                    world=wanted.world,
                    step=wanted.step,
                    into=self.segment(wanted.local_rank),
                )
            except (ReplicaError, SegmentError, OSError) as exc:
                log.error(
                    "cannot fetch a replica",
                    rank=wanted.rank,
                    step=wanted.step,
                    holder=wanted.holder.node_id,
                    error=str(exc),
                )
                return wanted, str(exc)
            log.info(
                "replica fetched",
                rank=wanted.rank,
                step=wanted.step,
                holder=wanted.holder.node_id,
                seconds=round(seconds, 4),
            )
        return None

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the persister once it has written what it was asked, then free the memory."""
        if self._replica_sender is not None:
            self._replica_sender.close()
        if self.replica_server is not None:
            self.replica_server.close()
        with self._lock:
            self._stopping.set()
            proc = self._process
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("persister did not stop; killing it", pid=proc.pid)
                proc.kill()
                proc.wait()
        for thread in [self._supervisor, self._watchdog, *self._readers]:
            if thread is not None:
                thread.join(timeout=5)
        remove_segments(self.prefix)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    # -- memory --------------------------------------------------------------------------------

    def holdings(self, procs: int) -> list[MemoryHolding]:
        """The complete steps each local rank's segment holds (read while no worker runs)."""
        held = []
        for local_rank in range(procs):
            path = self.segment(local_rank)
            try:
                segment = Segment.open(path)
            except FileNotFoundError:
                continue
            except (OSError, SegmentError) as exc:
                log.warning("ignoring shared memory segment", path=str(path), error=str(exc))
                continue
            try:
                valid = segment.valid()
            finally:
                segment.close()
            if valid:
                newest = valid[0]
                steps = {i.step for i in valid if (i.rank, i.world) == (newest.rank, newest.world)}
                held.append(
                    MemoryHolding(
                        local_rank=local_rank,
                        rank=newest.rank,
                        world=newest.world,
                        steps=sorted(steps, reverse=True),
                    )
                )
        return held

    async def persist(
        self, step: int, local_ranks: list[int], timeout: float, generation: int
    ) -> list[str]:
        """Have the persister pin ``step`` in these ranks' memory (so restarted workers cannot
        overwrite it) and write it in the background; returns the errors of pinning."""
        return await asyncio.to_thread(self._persist, step, local_ranks, timeout, generation)

    def _persist(
        self, step: int, local_ranks: list[int], timeout: float, generation: int
    ) -> list[str]:
        # Pin every rank's copy first; the persister of rank 0 commits once every shard is in.
        errors: list[str] = []
        pinned: list[tuple[int, socket.socket, Any]] = []
        for local_rank in local_ranks:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            reader = sock.makefile("rb")
            try:
                sock.settimeout(timeout)
                sock.connect(str(self.socket_path))
                hello = {
                    "op": "hello",
                    "segment": str(self.segment(local_rank)),
                    "generation": generation,
                }
                persister.ask(sock, reader, hello, "ready")
                persister.ask(sock, reader, {"op": "persist", "step": step}, "pinned")
            except (OSError, ValueError) as exc:
                errors.append(f"local rank {local_rank}: {exc}")
                sock.close()
                continue
            pinned.append((local_rank, sock, reader))
        if pinned:
            threading.Thread(
                target=self._drain, args=(pinned,), name="persist-on-fault", daemon=True
            ).start()
        return errors

    def _drain(self, pinned: list[tuple[int, socket.socket, Any]]) -> None:
        """Wait until the pinned steps are written (their errors arrive as persister events),
        then let the persister go."""
        for _, sock, reader in pinned:
            with contextlib.suppress(OSError, ValueError):
                sock.settimeout(None)
                persister.ask(sock, reader, {"op": "wait"}, "idle")
            sock.close()


def _describe(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    return f"killed by {process.signal_name(-code)}"
