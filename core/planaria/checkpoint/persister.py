"""The persister: a process that copies saved steps from shared memory to storage.

Under ``planaria run`` the agent starts one per node; a standalone :class:`Checkpointer` starts
its own. Workers talk to it over a Unix socket in JSON lines::

    -> {"op": "hello", "segment": "/dev/shm/planaria-...-ckpt-0", "storage": {...}}
    -> {"op": "persist", "step": 120}      <- {"op": "pinned", "step": 120}
                                           or {"op": "error", "step": 120, "error": "..."}
    -> {"op": "wait"}                      <- {"op": "idle", "errors": [...]}

``storage`` (``{backend, options}``, and ``keep_last``) is optional: a worker whose script names its
own storage brings it; otherwise the storage this persister was started with is used. The choice
is remembered per segment, so a persist at fault by the agent goes where the worker's go.

``persist`` answers as soon as the slot holding the step is pinned (a shared lock, so training's
next saves use the other slot); the shard is written in the background. ``wait`` answers once
everything this connection asked for is durable (and, for rank 0, committed). The persister that
writes rank 0's shard commits the step once every rank's shard is there.

Events (``shard_persisted``, ``checkpoint_committed``, ``persist_failed``) are written as JSON lines
to ``--events-fd`` when given (the agent forwards them to the master) and logged.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from planaria.checkpoint.segment import Segment, SlotInfo, remove_segments
from planaria.checkpoint.storage import build_storage
from planaria.checkpoint.store import CheckpointStore
from planaria.errors import PlanariaError
from planaria.log import configure, get_logger

log = get_logger("persister")

SOCKET_DIR_PREFIX = "planaria-ckpt-"
"""A standalone trainer's persister socket lives in a temporary directory named so; the
persister removes it when it exits, also when the trainer was killed."""


@dataclass
class _Pending:
    step: int
    info: SlotInfo | None = None


@dataclass
class _Connection:
    sock: socket.socket
    segment: Segment | None = None
    store: CheckpointStore | None = None
    work: queue.Queue[_Pending | None] = field(default_factory=queue.Queue)
    outstanding: int = 0
    commits: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    lock: threading.Condition = field(default_factory=threading.Condition)


class Persister:
    def __init__(
        self,
        store: CheckpointStore,
        events: TextIO | None = None,
        commit_timeout: float = 600.0,
    ) -> None:
        self.store = store
        self._stores: dict[str, CheckpointStore] = {}
        self._segment_stores: dict[str, CheckpointStore] = {}
        self._stores_lock = threading.Lock()
        self.events = events
        self.commit_timeout = commit_timeout
        self._events_lock = threading.Lock()
        self._commits: queue.Queue[tuple[CheckpointStore, int, int, _Connection] | None] = (
            queue.Queue()
        )
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._connections: list[_Connection] = []
        committer = threading.Thread(target=self._commit_loop, name="commit", daemon=True)
        committer.start()
        self._committer = committer

    # -- events ----------------------------------------------------------------------------

    def emit(self, kind: str, **fields: Any) -> None:
        record = {"event": kind, "time": time.time(), **fields}
        level = "warning" if kind == "persist_failed" else "info"
        getattr(log, level)(kind.replace("_", " "), **fields)
        if self.events is not None:
            with self._events_lock, contextlib.suppress(OSError, ValueError):
                self.events.write(json.dumps(record) + "\n")
                self.events.flush()

    # -- serving ---------------------------------------------------------------------------

    def serve(self, listener: socket.socket) -> None:
        listener.settimeout(0.2)
        while not self._stopping.is_set():
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            sock.settimeout(None)
            conn = _Connection(sock)
            self._connections.append(conn)
            for target, name in ((self._receive, "receive"), (self._persist_loop, "persist")):
                thread = threading.Thread(target=target, args=(conn,), name=name, daemon=True)
                thread.start()
                self._threads.append(thread)

    def stop(self) -> None:
        """Stop accepting; finish what was asked (pinned steps are still persisted)."""
        self._stopping.set()
        for conn in self._connections:
            conn.work.put(None)
        for thread in self._threads:
            if thread.name == "persist":
                thread.join()
        self._commits.put(None)
        self._committer.join()

    def _send(self, conn: _Connection, message: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            conn.sock.sendall(json.dumps(message).encode() + b"\n")

    def _receive(self, conn: _Connection) -> None:
        reader = conn.sock.makefile("rb")
        try:
            for line in reader:
                try:
                    request = json.loads(line)
                    op = request["op"]
                except (ValueError, KeyError, TypeError):
                    self._send(conn, {"op": "error", "error": f"bad request {line[:200]!r}"})
                    continue
                if op == "hello":
                    self._hello(conn, request)
                elif op == "persist":
                    self._pin(conn, int(request.get("step", -1)))
                elif op == "wait":
                    threading.Thread(target=self._wait, args=(conn,), daemon=True).start()
                else:
                    self._send(conn, {"op": "error", "error": f"unknown op {op!r}"})
        except OSError:
            pass
        finally:
            conn.work.put(None)

    def _store_for(self, path: str, spec: Any, keep_last: Any) -> CheckpointStore:
        with self._stores_lock:
            if spec is None:
                return self._segment_stores.get(path, self.store)
            key = json.dumps([spec, keep_last], sort_keys=True)
            if key not in self._stores:
                keep = int(keep_last) if keep_last is not None else self.store.keep_last
                self._stores[key] = CheckpointStore(build_storage(spec), keep)
            self._segment_stores[path] = self._stores[key]
            return self._stores[key]

    def _hello(self, conn: _Connection, request: dict[str, Any]) -> None:
        path = str(request.get("segment", ""))
        try:
            store = self._store_for(path, request.get("storage"), request.get("keep_last"))
            segment = Segment.open(Path(path))
        except (OSError, PlanariaError, RuntimeError, ValueError, TypeError) as exc:
            self._send(conn, {"op": "error", "error": f"cannot persist {path}: {exc}"})
            return
        if conn.segment is not None:
            conn.segment.close()
        conn.segment, conn.store = segment, store
        self._send(conn, {"op": "ready"})

    def _pin(self, conn: _Connection, step: int) -> None:
        if conn.segment is None:
            self._send(conn, {"op": "error", "step": step, "error": "no segment: send hello"})
            return
        try:
            info = conn.segment.pin(step)
        except LookupError as exc:
            self._send(conn, {"op": "error", "step": step, "error": str(exc)})
            return
        with conn.lock:
            conn.outstanding += 1
        conn.work.put(_Pending(step, info))
        self._send(conn, {"op": "pinned", "step": step})

    def _wait(self, conn: _Connection) -> None:
        with conn.lock:
            while conn.outstanding or conn.commits:
                conn.lock.wait()
            errors, conn.errors = conn.errors, []
        self._send(conn, {"op": "idle", "errors": errors})

    def _persist_loop(self, conn: _Connection) -> None:
        while True:
            item = conn.work.get()
            if item is None or item.info is None:
                break
            self._persist(conn, item.info)
        while not conn.work.empty():  # a stop: still persist what is pinned
            item = conn.work.get_nowait()
            if item is not None and item.info is not None:
                self._persist(conn, item.info)

    def _persist(self, conn: _Connection, info: SlotInfo) -> None:
        segment, store = conn.segment, conn.store
        assert segment is not None and store is not None
        started = time.time()
        try:
            if info.step in store.committed_steps():
                # Committed already (a persist at fault of a persisted step, or a run that
                # resumed into the same storage): the committed copy stays untouched.
                log.info("step already committed; not persisted again", step=info.step)
                return
            meta = segment.meta(info)
            record = store.write_shard(info.step, info.rank, info.world, segment.data(info), meta)
            self.emit(
                "shard_persisted",
                step=info.step,
                rank=info.rank,
                bytes=record.size,
                seconds=round(time.time() - started, 4),
            )
            if info.rank == 0:
                with conn.lock:
                    conn.commits.add(info.step)
                self._commits.put((store, info.step, info.world, conn))
        except (OSError, PlanariaError, ValueError) as exc:
            message = f"step {info.step} rank {info.rank}: {exc}"
            self.emit("persist_failed", step=info.step, rank=info.rank, error=str(exc))
            with conn.lock:
                conn.errors.append(message)
        finally:
            segment.unpin(info)
            with conn.lock:
                conn.outstanding -= 1
                conn.lock.notify_all()

    def _commit_loop(self) -> None:
        while True:
            item = self._commits.get()
            if item is None:
                return
            store, step, world, conn = item
            try:
                self._commit(store, step, world)
            except (OSError, PlanariaError, ValueError) as exc:
                self.emit("persist_failed", step=step, rank=0, error=f"commit: {exc}")
                with conn.lock:
                    conn.errors.append(f"step {step}: commit failed: {exc}")
            finally:
                with conn.lock:
                    conn.commits.discard(step)
                    conn.lock.notify_all()

    def _commit(self, store: CheckpointStore, step: int, world: int) -> None:
        started = time.time()
        delay = 0.01
        while not store.ready_to_commit(step, world):
            if time.time() - started > self.commit_timeout:
                raise TimeoutError(
                    f"not every rank's shard arrived within {self.commit_timeout:g}s"
                )
            if self._stopping.is_set() and time.time() - started > 5:
                raise TimeoutError("stopped before every rank's shard arrived")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        manifest = store.commit(step, world)
        total = sum(f["size"] for f in manifest["files"].values())
        self.emit(
            "checkpoint_committed",
            step=step,
            world=world,
            bytes=total,
            seconds=round(time.time() - started, 4),
        )


# -- the client side (agents and checkpointers) ---------------------------------------------------


def command(
    socket_path: str | Path, storage: dict[str, Any], keep_last: int, remove_segments: str
) -> list[str]:
    """The persister's command line: it serves ``socket_path``, exits once this process (its
    parent) is gone, and then removes the files starting with ``remove_segments``."""
    return [
        sys.executable,
        "-m",
        "planaria.checkpoint.persister",
        "--socket",
        str(socket_path),
        "--storage",
        json.dumps(storage),
        "--keep-last",
        str(keep_last),
        "--parent",
        str(os.getpid()),
        "--remove-segments",
        remove_segments,
    ]


def ask(sock: socket.socket, reader: Any, message: dict[str, Any], expect: str) -> dict[str, Any]:
    """Send one request and read its answer; :class:`OSError` unless it is ``expect``."""
    sock.sendall(json.dumps(message).encode() + b"\n")
    line = reader.readline()
    if not line:
        raise ConnectionError("the checkpoint persister went away")
    reply: dict[str, Any] = json.loads(line)
    if reply.get("op") != expect:
        raise OSError(f"checkpoint persister: {reply.get('error', reply)}")
    return reply


def _watch_parent(pid: int, done: threading.Event) -> None:
    while not done.is_set():
        if os.getppid() != pid:
            done.set()
            return
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m planaria.checkpoint.persister")
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--storage", required=True, help="JSON: {backend, options}")
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--parent", type=int, default=0, help="exit when this process ends")
    parser.add_argument("--events-fd", type=int, default=-1)
    parser.add_argument("--remove-segments", default="", help="segment prefix to remove at exit")
    parser.add_argument("--commit-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    # Logs go to stderr: stdout carries the "ready" handshake of a standalone persister.
    configure(stream=sys.stderr)

    try:
        storage = build_storage(json.loads(args.storage))
    except (ValueError, PlanariaError) as exc:
        print(f"persister: bad storage: {exc}", file=sys.stderr)
        return 2
    events = os.fdopen(args.events_fd, "w", buffering=1) if args.events_fd >= 0 else None
    persister = Persister(CheckpointStore(storage, args.keep_last), events, args.commit_timeout)

    with contextlib.suppress(FileNotFoundError):
        args.socket.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        listener.bind(str(args.socket))
    finally:
        os.umask(old_umask)
    listener.listen(64)

    done = threading.Event()
    if args.parent:
        threading.Thread(target=_watch_parent, args=(args.parent, done), daemon=True).start()
    server = threading.Thread(target=persister.serve, args=(listener,), daemon=True)
    server.start()
    if events is not None:
        persister.emit("persister_ready", pid=os.getpid())
    else:
        print("ready", flush=True)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with contextlib.suppress(KeyboardInterrupt):
        done.wait()
    persister.stop()
    listener.close()
    with contextlib.suppress(FileNotFoundError):
        args.socket.unlink()
    if args.socket.parent.name.startswith(SOCKET_DIR_PREFIX):  # a standalone trainer's
        with contextlib.suppress(OSError):
            args.socket.parent.rmdir()
    if args.remove_segments:
        remove_segments(args.remove_segments)
    return 0


if __name__ == "__main__":
    sys.exit(main())
