"""The persister: a process that copies saved steps from shared memory to storage.

Under ``planaria run`` the agent starts one per node; a standalone :class:`Checkpointer` starts
its own. Workers talk to it over a Unix socket in JSON lines::

    -> {"op": "hello", "segment": "/dev/shm/planaria-...-ckpt-0", "storage": {...}}
    -> {"op": "persist", "step": 120}      <- {"op": "pinned", "step": 120}
                                           or {"op": "error", "step": 120, "error": "..."}
    -> {"op": "wait"}                      <- {"op": "idle", "errors": [...]}
    -> {"op": "report", "event": "checkpoint_skipped", "step": 20, ...}   <- {"op": "reported"}
    -> {"op": "sync", "token": "..."}      <- {"op": "synced"}
    -> {"op": "ping"}                      <- {"op": "pong"}

``storage`` (``{backend, options}``, and ``keep_last``) is optional: a worker whose script names its
own storage brings it; otherwise the storage this persister was started with is used. The choice
is remembered per segment, so a persist at fault by the agent goes where the worker's go.

``persist`` answers as soon as the slot holding the step is pinned (a shared lock, so training's
next saves use the other slot), or at once if the step is committed already; the shard is written
in the background. ``wait`` answers once everything this connection asked for is durable (and,
for rank 0, committed or given up). The persister that writes rank 0's shard commits the step
once every rank's shard is there (:mod:`planaria.checkpoint.committer`). ``hello`` may name the
steps a restore rejected (``rejected``): they never count as kept, and are replaced when the same
step is committed again.

Events (``shard_persisted``, ``checkpoint_committed``, ``persist_failed``) are written as JSON lines
to ``--events-fd`` when given (the agent forwards them to the master) and logged. ``report``
passes a worker's restore outcome on the same way (``checkpoint_skipped``,
``started_from_scratch``); ``sync`` writes a ``synced`` event carrying its token, so that the agent
knows every event before it was read.

The persister follows its parent (``--parent``): it is told at once when the parent dies
(``PR_SET_PDEATHSIG``), polls as a backstop, and then finishes what was pinned and exits within
a bounded time (``--stop-timeout``), giving steps that still wait for shards one grace period.

Why one module: the protocol above, the server that answers it (:class:`Persister`) and the
process that runs it (:func:`main`) change together; :func:`command` and :func:`ask` are what
its two clients (a trainer's :mod:`~planaria.checkpoint.persister_client`, the agent's
:mod:`~planaria.agent.checkpoints`) need of it. A trainer's side of the protocol, with its
reconnects and replacements, is :mod:`planaria.checkpoint.persister_client`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from planaria import process
from planaria.checkpoint.committer import Commit, Committer
from planaria.checkpoint.persisted import PersistedCheckpoints
from planaria.checkpoint.segment import Segment, SlotInfo, remove_segments
from planaria.errors import PlanariaError
from planaria.log import configure, get_logger
from planaria.shm import name_prefix, remove_dir

log = get_logger("persister")

SOCKET_DIR_KIND = "ckpt-"
"""A standalone trainer's segment and persister socket live in a private directory in /dev/shm
named :func:`planaria.shm.name_prefix` then this; the persister removes it when it exits, also
when the trainer was killed."""

STOP_GRACE = 5.0
"""At exit, how long steps still waiting for another rank's shard may wait, all together."""
SHARDS_REMEMBERED = 1024
"""How many shards written here are remembered, to join a second persist of the same one."""
REPORTS = ("checkpoint_skipped", "started_from_scratch")
"""What a worker may report through its persister (its restore's outcome)."""


@dataclass
class _Pending:
    step: int
    info: SlotInfo | None = None


@dataclass
class _Connection:
    sock: socket.socket
    segment: Segment | None = None
    store: PersistedCheckpoints | None = None
    generation: int = 0
    """The round of the worker (or agent) on this connection: its shards and commits carry it."""
    work: queue.Queue[_Pending | None] = field(default_factory=queue.Queue)
    outstanding: int = 0
    commits: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    closed: bool = False
    lock: threading.Condition = field(default_factory=threading.Condition)


class Persister:
    def __init__(
        self,
        store: PersistedCheckpoints,
        events: TextIO | None = None,
        commit_timeout: float = 600.0,
    ) -> None:
        self.store = store
        self._stores: dict[str, PersistedCheckpoints] = {}
        self._segment_stores: dict[str, PersistedCheckpoints] = {}
        self._stores_lock = threading.Lock()
        self.events = events
        self.commit_timeout = commit_timeout
        self._events_lock = threading.Lock()
        self._committer = Committer(self.emit, commit_timeout)
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._connections: list[_Connection] = []
        self._shards: dict[tuple[int, int, int], None] = {}
        """(store, step, rank) of every shard written or being written here: a second persist
        of the same shard (at a fault, by the agent, of a step the worker persisted) joins the
        first instead of writing into a partial step that its commit may be renaming."""
        self._shards_lock = threading.Lock()

    # -- events ----------------------------------------------------------------------------

    def emit(self, kind: str, **fields: Any) -> None:
        record = {"event": kind, "time": time.time(), **fields}
        level = {"persist_failed": "warning", "synced": "debug"}.get(kind, "info")
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
            # Forget connections and threads that ended (an agent pings every few seconds).
            self._connections = [c for c in self._connections if not c.closed]
            self._threads = [t for t in self._threads if t.is_alive()]
            self._connections.append(conn)
            for target, name in ((self._receive, "receive"), (self._persist_loop, "persist")):
                thread = threading.Thread(target=target, args=(conn,), name=name, daemon=True)
                thread.start()
                self._threads.append(thread)

    def stop(self, timeout: float = 60.0) -> None:
        """Stop accepting; finish what was asked (pinned steps are still persisted) within
        ``timeout``; steps still waiting for other ranks' shards get :data:`STOP_GRACE`."""
        deadline = time.monotonic() + timeout
        self._stopping.set()
        for conn in self._connections:
            conn.work.put(None)
        for thread in self._threads:
            if thread.name == "persist":
                thread.join(max(0.0, deadline - time.monotonic()))
        self._committer.stop(STOP_GRACE, max(0.0, deadline - time.monotonic()))

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
                elif op == "report":
                    self._report(conn, request)
                elif op == "ping":  # whether this process still answers (its agent asks)
                    self._send(conn, {"op": "pong"})
                elif op == "sync":
                    self.emit("synced", token=str(request.get("token", "")))
                    self._send(conn, {"op": "synced"})
                else:
                    self._send(conn, {"op": "error", "error": f"unknown op {op!r}"})
        except OSError:
            pass
        finally:
            conn.closed = True
            conn.work.put(None)

    def _store_for(self, path: str, spec: Any, keep_last: Any) -> PersistedCheckpoints:
        with self._stores_lock:
            if spec is None:
                return self._segment_stores.get(path, self.store)
            key = json.dumps([spec, keep_last], sort_keys=True)
            if key not in self._stores:
                keep = int(keep_last) if keep_last is not None else self.store.keep_last
                self._stores[key] = PersistedCheckpoints.open(spec, keep)
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
        rejected = request.get("rejected") or []
        if isinstance(rejected, list):
            store.reject(s for s in rejected if isinstance(s, int) and not isinstance(s, bool))
        if conn.segment is not None:
            conn.segment.close()
        conn.segment, conn.store = segment, store
        generation = request.get("generation", 0)
        conn.generation = generation if isinstance(generation, int) and generation >= 0 else 0
        self._send(conn, {"op": "ready"})

    def _report(self, conn: _Connection, request: dict[str, Any]) -> None:
        """A worker's restore outcome, passed on as an event."""
        event = request.get("event")
        types = {"step": int, "rank": int, "error": str, "steps": list}
        fields = {k: request[k] for k, t in types.items() if isinstance(request.get(k), t)}
        if event not in REPORTS:
            self._send(conn, {"op": "error", "error": f"cannot report {event!r}"})
            return
        self.emit(str(event), **fields)
        self._send(conn, {"op": "reported"})

    def _pin(self, conn: _Connection, step: int) -> None:
        if conn.segment is None:
            self._send(conn, {"op": "error", "step": step, "error": "no segment: send hello"})
            return
        try:
            info = conn.segment.pin(step)
        except LookupError as exc:
            if conn.store is not None and conn.store.usable(step):
                self._send(conn, {"op": "pinned", "step": step, "committed": True})
                return
            self.emit("persist_failed", step=step, error=str(exc))
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
        shard = (id(store), info.step, info.rank)
        with self._shards_lock:
            duplicate = shard in self._shards
            self._shards[shard] = None
            if len(self._shards) > SHARDS_REMEMBERED:
                del self._shards[next(iter(self._shards))]
        written = False
        try:
            if duplicate:
                log.info("shard persisted here already; not written again", step=info.step)
                return
            if store.usable(info.step):
                # Committed already (a persist at fault of a persisted step, or a run that
                # resumed into the same storage): the committed copy stays untouched. One that
                # does not verify is written again and replaced at the commit.
                log.info("step already committed; not persisted again", step=info.step)
                return
            meta = segment.meta(info)
            record = store.write_shard(
                info.step, info.rank, info.world, segment.data(info), meta, conn.generation
            )
            self.emit(
                "shard_persisted",
                step=info.step,
                rank=info.rank,
                bytes=record.size,
                seconds=round(time.time() - started, 4),
            )
            written = True
            if info.rank == 0:
                with conn.lock:
                    conn.commits.add(info.step)
                done = self._commit_done(conn, info.step, shard)
                commit = Commit(store, info.step, info.world, done, generation=conn.generation)
                self._committer.submit(commit)
        except (OSError, PlanariaError, ValueError) as exc:
            if not written and store.usable(info.step):
                # Committed while this copy was being written (its partial step renamed away
                # under it): the step is durable, nothing failed.
                log.info("step committed meanwhile; not persisted again", step=info.step)
                return
            message = f"step {info.step} rank {info.rank}: {exc}"
            self.emit("persist_failed", step=info.step, rank=info.rank, error=str(exc))
            with conn.lock:
                conn.errors.append(message)
            # The step will never commit: say so to the rank that commits it, and, on that
            # rank, have the step's partial removed once every rank is accounted for.
            store.fail_shard(info.step, info.rank)
            if info.rank == 0:
                self._committer.submit(Commit(store, info.step, info.world, cleanup=True))
        finally:
            if not written and not duplicate:
                with self._shards_lock:
                    self._shards.pop(shard, None)
            segment.unpin(info)
            with conn.lock:
                conn.outstanding -= 1
                conn.lock.notify_all()

    def _commit_done(self, conn: _Connection, step: int, shard: tuple[int, int, int]) -> Any:
        def done(error: str | None) -> None:
            if error is not None:  # given up: a later persist of the step writes it again
                with self._shards_lock:
                    self._shards.pop(shard, None)
            with conn.lock:
                if error is not None:
                    conn.errors.append(error)
                conn.commits.discard(step)
                conn.lock.notify_all()

        return done


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


def ask(
    sock: socket.socket, reader: Any, message: dict[str, Any], expect: str, *, send: bool = True
) -> dict[str, Any]:
    """Send one request (unless sent already) and read its answer; :class:`OSError` unless it
    is ``expect``."""
    if send:
        sock.sendall(json.dumps(message).encode() + b"\n")
    line = reader.readline()
    if not line:
        raise ConnectionError("the checkpoint persister went away")
    reply: dict[str, Any] = json.loads(line)
    if reply.get("op") != expect:
        raise OSError(f"checkpoint persister: {reply.get('error', reply)}")
    return reply


def _follow_parent(pid: int, done: threading.Event) -> None:
    """Set ``done`` once process ``pid`` (the parent) is gone. The kernel tells at once
    (SIGHUP, PR_SET_PDEATHSIG); it also tells when only the thread that started this process
    ends, hence the check of the parent's pid. A poll is the backstop (no prctl, a race)."""

    def parent_gone(*_: Any) -> None:
        if os.getppid() != pid:
            done.set()

    if sys.platform == "linux":
        signal.signal(signal.SIGHUP, parent_gone)
        process.die_with(pid, signal.SIGHUP)

    def poll() -> None:
        while not done.is_set():
            parent_gone()
            time.sleep(0.2)

    threading.Thread(target=poll, name="parent", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m planaria.checkpoint.persister")
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--storage", required=True, help="JSON: {backend, options}")
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--parent", type=int, default=0, help="exit when this process ends")
    parser.add_argument("--events-fd", type=int, default=-1)
    parser.add_argument("--remove-segments", default="", help="segment prefix to remove at exit")
    parser.add_argument("--commit-timeout", type=float, default=600.0)
    parser.add_argument(
        "--stop-timeout", type=float, default=60.0, help="at exit, the most time to finish in"
    )
    args = parser.parse_args(argv)
    # Logs go to stderr: stdout carries the "ready" handshake of a standalone persister.
    configure(stream=sys.stderr)

    try:
        store = PersistedCheckpoints.open(json.loads(args.storage), args.keep_last)
    except (ValueError, PlanariaError) as exc:
        print(f"persister: bad storage: {exc}", file=sys.stderr)
        return 2
    events = os.fdopen(args.events_fd, "w", buffering=1) if args.events_fd >= 0 else None
    persister = Persister(store, events, args.commit_timeout)

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
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    if args.parent:
        _follow_parent(args.parent, done)
    server = threading.Thread(target=persister.serve, args=(listener,), daemon=True)
    server.start()
    if events is not None:
        persister.emit("persister_ready", pid=os.getpid())
    else:
        print("ready", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        done.wait()
    persister.stop(args.stop_timeout)
    listener.close()
    with contextlib.suppress(FileNotFoundError):
        args.socket.unlink()
    if args.remove_segments:
        remove_segments(args.remove_segments)
    if args.socket.parent.name.startswith(name_prefix() + SOCKET_DIR_KIND):  # a standalone's
        remove_dir(args.socket.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
