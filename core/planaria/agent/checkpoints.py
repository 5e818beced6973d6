"""The agent's part of the flash checkpoint: it owns the node's shared memory and persister.

Workers' segments are named per node and local rank, so they outlive a worker and a restarted
worker finds its last steps in memory. Before each round the agent reads which steps its
segments hold (the master picks the step every rank can restore), and at a fault it can have the
persister write the agreed step. The persister is a separate process watching the agent: if the
agent dies, it finishes what it was asked to persist, removes the node's segments and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planaria.checkpoint import persister
from planaria.checkpoint.env import (
    KEEP_LAST_ENV,
    PERSIST_EVERY_ENV,
    RESTORE_ENV,
    SEGMENT_ENV,
    SOCKET_ENV,
    STORAGE_ENV,
)
from planaria.checkpoint.segment import Segment, SegmentError, remove_segments
from planaria.log import get_logger
from planaria.protocol import CheckpointSpec, MemoryHolding

log = get_logger("agent")


class NodeCheckpoints:
    """Names the node's segments, runs its persister, reads what memory holds."""

    def __init__(
        self, spec: CheckpointSpec, prefix: str, on_event: Callable[[dict[str, Any]], None]
    ) -> None:
        self.spec = spec
        self.prefix = prefix
        """``/dev/shm/planaria-<run>-<node>.``: every file of this node starts with it."""
        self.socket_path = Path(f"{prefix}sock")
        if len(str(self.socket_path)) > 100:  # the limit of a Unix socket's path
            digest = hashlib.sha1(prefix.encode()).hexdigest()[:16]
            self.socket_path = Path(prefix).parent / f"planaria-{digest}.sock"
        self.on_event = on_event
        self._process: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None

    def segment(self, local_rank: int) -> Path:
        return Path(f"{self.prefix}ckpt-{local_rank}")

    def worker_env(self, local_rank: int, restore: str) -> dict[str, str]:
        return {
            SOCKET_ENV: str(self.socket_path),
            SEGMENT_ENV: str(self.segment(local_rank)),
            RESTORE_ENV: restore,
            STORAGE_ENV: json.dumps(self.spec.storage),
            KEEP_LAST_ENV: str(self.spec.keep_last),
            PERSIST_EVERY_ENV: str(self.spec.persist_every),
        }

    # -- the persister -------------------------------------------------------------------------

    def start(self) -> None:
        read_fd, write_fd = os.pipe()
        try:
            argv = persister.command(
                self.socket_path, self.spec.storage, self.spec.keep_last, self.prefix
            )
            self._process = subprocess.Popen(
                [*argv, "--events-fd", str(write_fd)],
                pass_fds=(write_fd,),
                stdin=subprocess.DEVNULL,
                # Its own session: a signal to the agent's process group must not cut a persist
                # short; it exits by itself once the agent is gone.
                start_new_session=True,
            )
        finally:
            os.close(write_fd)
        self._reader = threading.Thread(
            target=self._read_events, args=(read_fd,), name="persister-events", daemon=True
        )
        self._reader.start()

    def _read_events(self, fd: int) -> None:
        with os.fdopen(fd, "r", encoding="utf-8", errors="replace") as stream:
            for line in stream:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") == "persister_ready":
                    continue  # workers retry their connection while it starts
                self.on_event(event)

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the persister once it has written what it was asked, then free the memory."""
        process = self._process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("persister did not stop; killing it", pid=process.pid)
                process.kill()
                process.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
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

    async def persist(self, step: int, local_ranks: list[int], timeout: float) -> list[str]:
        """Have the persister pin ``step`` in these ranks' memory (so restarted workers cannot
        overwrite it) and write it in the background; returns the errors of pinning."""
        return await asyncio.to_thread(self._persist, step, local_ranks, timeout)

    def _persist(self, step: int, local_ranks: list[int], timeout: float) -> list[str]:
        # Pin every rank's copy first; the persister of rank 0 commits once every shard is in.
        errors: list[str] = []
        pinned: list[tuple[int, socket.socket, Any]] = []
        for local_rank in local_ranks:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            reader = sock.makefile("rb")
            try:
                sock.settimeout(timeout)
                sock.connect(str(self.socket_path))
                persister.ask(
                    sock, reader, {"op": "hello", "segment": str(self.segment(local_rank))}, "ready"
                )
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
