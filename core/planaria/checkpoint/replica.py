"""Peer replicas: each node's newest saved step, copied into a buddy node's shared memory.

A node's loss takes its ranks' flash checkpoints with it: without a copy elsewhere, its
replacement restores from storage, and every step since the last persist is redone. With
``checkpoint.replica`` each agent runs a :class:`ReplicaSender` and a :class:`ReplicaServer`.
The sender watches the node's segments and copies each rank's newest saved step to the next
node of the ring (the master names it each round), where the server keeps it in a segment of
the same format as a worker's own. When a node is lost, its replacement copies the lost ranks'
step from the buddy (:func:`fetch`) into its own segments before its workers start, and every
rank of the new world then restores from memory.

What a copy is checked for:

- **Torn reads.** The sender reads a slot without a lock (a lock would make a save wait for
  the network) and checks afterwards that the slot still holds the step it started with (its
  sequence number, as a seqlock). A save that wrote over it in the meantime voids the copy;
  the next, newer step is sent instead.
- **Corruption.** An xxh3-64 checksum of the bytes (the one the persister's manifests use,
  fast enough to cost less than the copy), computed by the sender, checked by the receiver
  before it marks the slot valid; the same for a fetch.
- **Fencing.** Each copy carries the sender's round. A server takes no copy from a round older
  than its own node's: a node cut off from the job cannot overwrite the replica of the world
  that replaced it.
- **Who may talk.** A connection proves it knows the job's token (an HMAC of a nonce the
  server sends) before anything else. The bytes themselves go unencrypted, as
  torch.distributed's own traffic between the same nodes does.

Wire: TCP, each message a JSON line, then raw bytes where the request says. A connection
proves itself once (its first request carries the proof) and then serves requests one after
another until the peer closes it: a sender keeps one connection to its buddy for as long as
the buddy stays the same, so that a copy every step pays no connection, thread or handshake.
``put``: the header, ``{"ok": true}``, the step's data and metadata, a trailer
``{"xxh3": ..., "intact": ...}``, ``{"ok": true}``. ``get``: the request, a header with the
sizes, the bytes, a trailer with the checksum.

Why one module: the server, the sender and :func:`fetch` are the two ends of one wire protocol
(its messages, its checks, its authentication); apart, each end would hold half of a contract
that only holds whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, overload

import xxhash

from planaria.checkpoint.segment import Segment, SegmentError, SlotInfo
from planaria.log import get_logger
from planaria.protocol import ReplicaEndpoint, ReplicaHolding

log = get_logger("replica")

CHUNK = 4 << 20
"""Bytes sent or received at a time (and checked against the bandwidth bound)."""
TIMEOUT = 10.0
"""Seconds a silent peer is waited for, at any point of a request."""
IDLE = 600.0
"""Seconds a kept connection may wait for its next request (a step can take minutes)."""
LINK_IDLE = IDLE / 2
"""Seconds after which a sender connects anew rather than reuse its idle connection."""
MAX_CONNECTIONS = 64
"""Connections a replica server serves at once (a node's peers need a few)."""
MAX_LINE = 64 << 10
"""The longest JSON line taken from a peer."""
_CONTEXT = b"planaria-replica-v1"


class ReplicaError(RuntimeError):
    """A copy that did not arrive whole: the peer refused it, went away, or sent other bytes
    than it said."""


class _SavedOver(ReplicaError):
    """A save wrote over the slot being sent: no one's fault, the newer step goes next."""


def _proof(token: str, nonce: str) -> str:
    return hmac.new(token.encode(), _CONTEXT + bytes.fromhex(nonce), hashlib.sha256).hexdigest()


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


@overload
def _receive(reader: BinaryIO) -> dict[str, Any]: ...


@overload
def _receive(reader: BinaryIO, end_ok: bool) -> dict[str, Any] | None: ...


def _receive(reader: BinaryIO, end_ok: bool = False) -> dict[str, Any] | None:
    """The next message; None at the end of the connection where ``end_ok`` (between
    requests), else an error."""
    line = reader.readline(MAX_LINE + 1)
    if not line:
        if end_ok:
            return None
        raise ReplicaError("the peer closed the connection")
    if len(line) > MAX_LINE or not line.endswith(b"\n"):
        raise ReplicaError("the peer sent a line too long")
    try:
        message = json.loads(line)
    except ValueError:
        raise ReplicaError(f"the peer sent no JSON: {line[:80]!r}") from None
    if not isinstance(message, dict):
        raise ReplicaError(f"the peer sent {type(message).__name__}, not an object")
    if "error" in message:
        raise ReplicaError(f"the peer refused: {message['error']}")
    return message


def _integer(message: dict[str, Any], key: str, low: int = 0) -> int:
    value = message.get(key)
    if type(value) is not int or value < low:
        raise ReplicaError(f"{key!r} must be an integer >= {low}, not {value!r}")
    return value


def _receive_into(reader: BinaryIO, view: memoryview, length: int) -> str:
    """Read exactly ``length`` bytes into ``view``; their xxh3-64 checksum (hex)."""
    digest, done = xxhash.xxh3_64(), 0
    while done < length:
        got = reader.readinto(view[done : min(length, done + CHUNK)])  # type: ignore[attr-defined]
        if not got:
            raise ReplicaError(f"the peer went away after {done} of {length} bytes")
        digest.update(view[done : done + got])
        done += got
    return digest.hexdigest()


class _Pace:
    """Holds a sender to ``per_second`` bytes a second (None: as fast as it goes)."""

    def __init__(self, per_second: float | None) -> None:
        self.per_second = per_second
        self.started = time.monotonic()
        self.sent = 0

    def sent_bytes(self, count: int) -> None:
        self.sent += count
        if self.per_second:
            ahead = self.sent / self.per_second - (time.monotonic() - self.started)
            if ahead > 0:
                time.sleep(ahead)


def _stream(
    sock: socket.socket, segment: Segment, info: SlotInfo, pace: _Pace | None = None
) -> str:
    """Send a slot's data and metadata; their xxh3-64 checksum (hex)."""
    digest = xxhash.xxh3_64()
    total = info.data_len + info.meta_len
    view = segment.payload(info)
    try:
        for start in range(0, total, CHUNK):
            chunk = view[start : start + CHUNK]
            digest.update(chunk)
            sock.sendall(chunk)
            if pace is not None:
                pace.sent_bytes(len(chunk))
    finally:
        view.release()
    return digest.hexdigest()


def _take(
    segment: Segment,
    reader: BinaryIO,
    *,
    step: int,
    rank: int,
    world: int,
    sizes: tuple[int, int],
    sender: str,
    ready: Callable[[], None] | None = None,
) -> None:
    """Receive a step's data and metadata into a free slot of ``segment`` and mark it valid
    once the trailer's checksum matches (and the sender says no save wrote over it meanwhile).
    ``ready``: called once the slot is held, before the bytes are asked for."""
    data_len, meta_len = sizes
    total = data_len + meta_len
    with segment.writing_bytes(wait=TIMEOUT) as (slot, view):
        if ready is not None:
            ready()
        digest = _receive_into(reader, view, total)
        trailer = _receive(reader)
        if trailer.get("intact", True) is not True:
            raise ReplicaError(f"step {step} changed while it was sent (not kept)")
        if trailer.get("xxh3") != digest:
            raise ReplicaError(
                f"step {step} of rank {rank} arrived corrupt (xxh3-64 {digest}, "
                f"{sender}'s {trailer.get('xxh3')!r})"
            )
        meta = bytes(view[data_len:total])
        segment.publish(slot, step=step, rank=rank, world=world, data_len=data_len, meta=meta)


def _connect(
    endpoint: ReplicaEndpoint, token: str, request: dict[str, Any] | None
) -> socket.socket:
    """A connection to ``endpoint`` that proved the job's token: with ``request`` as its
    first request, or (None) with a request of its own that only proves it."""
    sock = socket.create_connection((endpoint.addr, endpoint.port), timeout=TIMEOUT)
    try:
        reader = sock.makefile("rb")
        nonce = _receive(reader).get("nonce")
        if not isinstance(nonce, str):
            raise ReplicaError("the peer sent no nonce")
        _send(sock, {**(request or {"op": "hello"}), "auth": _proof(token, nonce)})
        if request is None:
            _receive(reader)  # the server's welcome: proven
    except BaseException:
        sock.close()
        raise
    return sock


# -- the server (the buddy's side) ---------------------------------------------------------------


STALE_AFTER = 30.0
"""Seconds into a round after which a replica no copy of the round refreshed is dropped."""


class ReplicaServer:
    """Keeps peers' replicas in this node's shared memory and hands them to a replacement.

    ``round``: the node's current round, set by its agent; copies from older rounds are
    refused (fencing). A replica the new round's ring no longer feeds (its rank's node now has
    another buddy) only grows stale: once a copy of the new round arrived and ``STALE_AFTER``
    seconds passed (a replacement fetches at the round's start), it is dropped, so that a
    node keeps the replicas of one ring, not of every ring the job had."""

    def __init__(self, directory: Path, token: str, host: str) -> None:
        self.directory = directory
        self._token = token
        self._round = -1
        self._round_started = time.monotonic()
        self._fed: dict[int, int] = {}
        """Rank -> the round of its last copy."""
        self._listener = socket.create_server((host, 0))
        self.port: int = self._listener.getsockname()[1]
        self._segments: dict[int, Segment] = {}
        self._sources: dict[int, str] = {}
        self._rank_locks: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.accepted = 0
        """Connections taken (for the tests: a sender keeps one)."""
        self._peers: set[socket.socket] = set()
        """Connections being served: shut down on :meth:`close`."""
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        """Connections served at once: more (before they prove anything) are closed."""
        self._thread = threading.Thread(target=self._accept, name="replica-server", daemon=True)
        self._thread.start()

    def path(self, rank: int) -> Path:
        return self.directory / f"replica-{rank}"

    @property
    def round(self) -> int:
        return self._round

    @round.setter
    def round(self, value: int) -> None:
        if value != self._round:
            self._round, self._round_started = value, time.monotonic()

    def _drop_stale(self) -> None:
        """Drop the replicas no copy of this round refreshed, once ``STALE_AFTER`` passed."""
        if time.monotonic() - self._round_started < STALE_AFTER:
            return
        with self._lock:
            stale = [r for r, fed in self._fed.items() if fed < self._round]
        for rank in stale:
            with self._rank_lock(rank):
                if self._fed.get(rank, self._round) >= self._round:
                    continue
                segment = self._segments.pop(rank, None)
                self._fed.pop(rank, None)
                self._sources.pop(rank, None)
                if segment is not None:
                    segment.close()
                    segment.unlink()
                log.info("dropped a replica the ring no longer feeds", rank=rank)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=5)
        with self._lock:
            peers = list(self._peers)
        for sock in peers:  # kept connections wait for their next request: end them
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            for segment in self._segments.values():
                segment.close()
            self._segments.clear()

    def holdings(self) -> list[ReplicaHolding]:
        """The complete steps of each rank this node keeps a replica of."""
        held = []
        with self._lock:
            ranks = sorted(self._segments)
        for rank in ranks:
            # Not under the rank's lock: a copy streaming in holds it for as long as the
            # network takes, and the agent asks between rounds. A slot being written is not
            # valid, so the descriptors can be read at any time.
            with self._lock:
                segment = self._segments.get(rank)
            try:
                valid = [] if segment is None else segment.valid()
            except (ValueError, OSError):  # closed meanwhile: made anew for a larger step
                continue
            if not valid:
                continue
            newest = valid[0]
            steps = {i.step for i in valid if (i.rank, i.world) == (newest.rank, newest.world)}
            held.append(
                ReplicaHolding(
                    rank=newest.rank,
                    world=newest.world,
                    steps=sorted(steps, reverse=True),
                    source=self._sources.get(rank, ""),
                )
            )
        return held

    def _rank_lock(self, rank: int) -> threading.Lock:
        with self._lock:
            return self._rank_locks.setdefault(rank, threading.Lock())

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):  # a flood: no thread for it
                sock.close()
                continue
            self.accepted += 1
            threading.Thread(
                target=self._serve, args=(sock, peer), name="replica-peer", daemon=True
            ).start()

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        with self._lock:
            self._peers.add(sock)
        try:
            self._answer(sock, peer)
        finally:
            with self._lock:
                self._peers.discard(sock)
            self._slots.release()

    def _answer(self, sock: socket.socket, peer: Any) -> None:
        with sock:
            sock.settimeout(TIMEOUT)
            reader = sock.makefile("rb")
            try:
                nonce = secrets.token_hex(16)
                _send(sock, {"nonce": nonce})
                request: dict[str, Any] | None = _receive(reader)
                proof = request.get("auth") if request else None
                if not isinstance(proof, str) or not hmac.compare_digest(
                    proof, _proof(self._token, nonce)
                ):
                    raise ReplicaError("not authorised (the job's token does not match)")
                while request is not None and not self._closed.is_set():
                    op = request.get("op")
                    if op == "put":
                        self._put(sock, reader, request)
                    elif op == "get":
                        self._get(sock, request)
                    elif op == "hello":  # a connection kept for the requests to come
                        _send(sock, {"ok": True})
                    else:
                        raise ReplicaError(f"unknown op {op!r} (put, get or hello)")
                    request = self._next(sock, reader, peer)
            except (ReplicaError, SegmentError, LookupError) as exc:
                log.warning("replica request refused", peer=str(peer), error=str(exc))
                with contextlib.suppress(OSError):
                    _send(sock, {"error": str(exc)})
            except OSError as exc:
                log.warning("replica connection failed", peer=str(peer), error=str(exc))
            except Exception as exc:  # a bug must not end the server with its thread
                log.error("replica request failed", peer=str(peer), error=repr(exc))
                with contextlib.suppress(OSError):
                    _send(sock, {"error": f"the server failed: {exc}"})

    @staticmethod
    def _next(sock: socket.socket, reader: BinaryIO, peer: Any) -> dict[str, Any] | None:
        """The connection's next request; None when the peer closed it, or left it idle for
        ``IDLE`` seconds (a sender copies once a step: it connects again if it comes back)."""
        sock.settimeout(IDLE)
        try:
            return _receive(reader, end_ok=True)
        except TimeoutError:
            log.debug("replica connection idle: closed", peer=str(peer))
            return None
        finally:
            sock.settimeout(TIMEOUT)

    def _put(self, sock: socket.socket, reader: BinaryIO, request: dict[str, Any]) -> None:
        round_ = _integer(request, "round")
        rank = _integer(request, "rank")
        world = _integer(request, "world", 1)
        step = _integer(request, "step")
        data_len = _integer(request, "data_len")
        meta_len = _integer(request, "meta_len", 1)
        capacity = _integer(request, "capacity", data_len + meta_len)
        source = str(request.get("source", ""))
        if rank >= world:
            raise ReplicaError(f"rank {rank} is not in a world of {world}")
        if round_ < self.round:
            raise ReplicaError(
                f"a copy from round {round_}, and this node is in round {self.round} (fenced)"
            )
        with self._rank_lock(rank):
            segment = self._segment(rank, capacity)
            _take(
                segment,
                reader,
                step=step,
                rank=rank,
                world=world,
                sizes=(data_len, meta_len),
                sender="the sender",
                ready=lambda: _send(sock, {"ok": True}),
            )
            self._sources[rank] = source
            self._fed[rank] = round_
        _send(sock, {"ok": True, "step": step})
        self._drop_stale()

    def _segment(self, rank: int, capacity: int) -> Segment:
        """Rank ``rank``'s replica segment, made (again) when it cannot hold ``capacity``."""
        with self._lock:
            segment = self._segments.get(rank)
        if segment is not None and segment.capacity >= capacity:
            return segment
        if segment is not None:
            segment.close()
        segment = Segment.create(self.path(rank), capacity)
        with self._lock:
            self._segments[rank] = segment
        return segment

    def _get(self, sock: socket.socket, request: dict[str, Any]) -> None:
        rank = _integer(request, "rank")
        world = _integer(request, "world", 1)
        step = _integer(request, "step")
        with self._rank_lock(rank):
            segment = self._segments.get(rank)
            if segment is None:
                raise LookupError(f"this node keeps no replica of rank {rank}")
            with segment.reading(step) as info:
                if (info.rank, info.world) != (rank, world):
                    raise LookupError(
                        f"the replica holds rank {info.rank} of {info.world}, not {rank} of {world}"
                    )
                header = {
                    "ok": True,
                    "data_len": info.data_len,
                    "meta_len": info.meta_len,
                    "capacity": segment.capacity,
                }
                _send(sock, header)
                _send(sock, {"xxh3": _stream(sock, segment, info)})


# -- a replacement's side ------------------------------------------------------------------------


def fetch(
    holder: ReplicaEndpoint, token: str, *, rank: int, world: int, step: int, into: Path
) -> float:
    """Copy ``rank``'s ``step`` from ``holder``'s replica into the segment at ``into`` (made
    if it cannot hold it), as a worker's own save; the seconds it took. Raises
    :class:`ReplicaError` if it does not arrive whole (nothing is then marked valid)."""
    started = time.perf_counter()
    request = {"op": "get", "rank": rank, "world": world, "step": step}
    try:
        with _connect(holder, token, request) as sock:
            reader = sock.makefile("rb")
            header = _receive(reader)
            data_len = _integer(header, "data_len")
            meta_len = _integer(header, "meta_len", 1)
            capacity = _integer(header, "capacity", data_len + meta_len)
            segment = _own_segment(into, capacity)
            try:
                _take(
                    segment,
                    reader,
                    step=step,
                    rank=rank,
                    world=world,
                    sizes=(data_len, meta_len),
                    sender=holder.node_id,
                )
            finally:
                segment.close()
    except OSError as exc:
        raise ReplicaError(
            f"cannot reach {holder.node_id} at {holder.addr}:{holder.port}: {exc}"
        ) from None
    return time.perf_counter() - started


def _own_segment(path: Path, capacity: int) -> Segment:
    if path.exists():
        with contextlib.suppress(OSError, SegmentError):
            segment = Segment.open(path, writable=True)
            if segment.capacity >= capacity:
                return segment
            segment.close()
    return Segment.create(path, capacity)


# -- the sender ----------------------------------------------------------------------------------


class ReplicaSender:
    """Copies each local rank's newest saved step to the round's buddy, in the background.

    It polls the segments' descriptors (a few reads of shared memory) and sends a rank's step
    once per buddy: after a round changes the buddy, the newest step goes to the new one at
    once, without waiting for the next save (a lost buddy's replica is rebuilt)."""

    POLL = 0.01

    def __init__(
        self,
        segments: Callable[[int], Path],
        procs: int,
        token: str,
        node_id: str,
        *,
        every: int = 1,
        max_bytes_per_second: float | None = None,
    ) -> None:
        self._segment_path = segments
        self._token = token
        self._node_id = node_id
        self.every = every
        self.max_bytes_per_second = max_bytes_per_second
        self._target: tuple[ReplicaEndpoint, int] | None = None
        self._sent: dict[int, tuple[str, int, int, int]] = {}
        """local rank -> (buddy, round, step, seq) of its last copy."""
        self._open: dict[int, Segment] = {}
        self._links: dict[int, tuple[ReplicaEndpoint, socket.socket, BinaryIO]] = {}
        """local rank -> its connection to the buddy, proven once and kept."""
        self._used: dict[int, float] = {}
        """local rank -> when its connection last served a copy."""
        self._failing: dict[str, float] = {}
        """Buddies that refused or could not be reached -> when to try again."""
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.copies = 0
        # A thread per local rank: one rank's copy does not wait for another's (each copy
        # waits for its buddy's answer), so a replica lags its rank by a step at most.
        self._threads = [
            threading.Thread(
                target=self._run, args=(local_rank,), name="replica-sender", daemon=True
            )
            for local_rank in range(procs)
        ]
        for thread in self._threads:
            thread.start()

    def target(self, buddy: ReplicaEndpoint | None, round_: int) -> None:
        """Send to ``buddy`` from now on, as round ``round_`` (None: to nobody)."""
        self._target = None if buddy is None else (buddy, round_)
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout=TIMEOUT + 5)
        for local_rank in list(self._links):
            self._unlink(local_rank)
        for segment in self._open.values():
            segment.close()
        self._open.clear()

    def _link(
        self, local_rank: int, buddy: ReplicaEndpoint
    ) -> tuple[socket.socket, BinaryIO, bool]:
        """The rank's connection to ``buddy``, and whether it is the one kept (else a new one:
        the buddy changed, the connection sat idle, or the last copy failed and dropped it)."""
        link = self._links.get(local_rank)
        idle = time.monotonic() - self._used.get(local_rank, 0.0)
        self._used[local_rank] = time.monotonic()
        if link is not None and link[0] == buddy and idle < LINK_IDLE:
            return link[1], link[2], True
        self._unlink(local_rank)
        sock = _connect(buddy, self._token, None)
        reader = sock.makefile("rb")
        self._links[local_rank] = (buddy, sock, reader)
        return sock, reader, False

    def _ask(
        self, local_rank: int, buddy: ReplicaEndpoint, request: dict[str, Any]
    ) -> socket.socket:
        """Send ``request`` and take the buddy's go-ahead, on the kept connection; once more on
        a new one if the kept one turns out closed (the buddy restarted, or closed it idle)."""
        sock, reader, kept = self._link(local_rank, buddy)
        try:
            _send(sock, request)
            _receive(reader)
            return sock
        except (OSError, ReplicaError):
            if not kept:
                raise
            self._unlink(local_rank)
        sock, reader, _ = self._link(local_rank, buddy)
        _send(sock, request)
        _receive(reader)
        return sock

    def _unlink(self, local_rank: int) -> None:
        link = self._links.pop(local_rank, None)
        if link is not None:
            with contextlib.suppress(OSError):
                link[2].close()
                link[1].close()

    def _run(self, local_rank: int) -> None:
        while not self._stop.is_set():
            target = self._target
            if target is not None:
                self._offer(local_rank, *target)
            self._wake.wait(self.POLL)  # a missed wake costs one poll, no more
            self._wake.clear()

    def _segment(self, local_rank: int) -> Segment | None:
        """The rank's segment, opened again when its worker made a new one."""
        path = self._segment_path(local_rank)
        segment = self._open.get(local_rank)
        try:
            inode = os.stat(path).st_ino
        except FileNotFoundError:
            inode = None
        if segment is not None and (inode is None or segment.inode() != inode):
            self._open.pop(local_rank).close()
            segment = None
        if segment is None and inode is not None:
            with contextlib.suppress(OSError, SegmentError):
                segment = self._open[local_rank] = Segment.open(path)
        return segment

    def _offer(self, local_rank: int, buddy: ReplicaEndpoint, round_: int) -> None:
        segment = self._segment(local_rank)
        if segment is None:
            return
        chosen = next((i for i in segment.valid() if i.step % self.every == 0), None)
        if chosen is None:
            return
        key = (buddy.node_id, round_, chosen.step, chosen.seq)
        last = self._sent.get(local_rank)
        if last is not None and last[:3] == key[:3]:
            return  # that step went to that buddy this round
        if self._failing.get(buddy.node_id, 0.0) > time.monotonic():
            return
        try:
            seconds = self._copy(local_rank, segment, chosen, buddy, round_)
        except _SavedOver:  # the newer step that wrote over it goes next
            self._unlink(local_rank)  # the buddy refused the copy and closed the connection
            return
        except (ReplicaError, OSError, SegmentError) as exc:
            self._unlink(local_rank)  # in an unknown state: the next copy connects anew
            if buddy.node_id not in self._failing:
                log.warning(
                    "cannot copy a step to the buddy node; trying again",
                    buddy=buddy.node_id,
                    step=chosen.step,
                    error=str(exc),
                )
            self._failing[buddy.node_id] = time.monotonic() + 1.0
            return
        self._failing.pop(buddy.node_id, None)
        self._sent[local_rank] = key
        self.copies += 1
        log.debug(
            "replica copied",
            buddy=buddy.node_id,
            rank=chosen.rank,
            step=chosen.step,
            seconds=round(seconds, 4),
        )

    def _copy(
        self,
        local_rank: int,
        segment: Segment,
        info: SlotInfo,
        buddy: ReplicaEndpoint,
        round_: int,
    ) -> float:
        """One step of one rank to the buddy; the seconds it took. :class:`_SavedOver` when a
        save wrote over it meanwhile."""
        started = time.perf_counter()
        request = {
            "op": "put",
            "round": round_,
            "rank": info.rank,
            "world": info.world,
            "step": info.step,
            "data_len": info.data_len,
            "meta_len": info.meta_len,
            "capacity": segment.capacity,
            "source": self._node_id,
        }
        sock = self._ask(local_rank, buddy, request)
        reader = self._links[local_rank][2]
        digest = _stream(sock, segment, info, _Pace(self.max_bytes_per_second))
        after = segment.info(info.slot)
        intact = after.valid and after.seq == info.seq
        _send(sock, {"xxh3": digest, "intact": intact})
        if not intact:  # told, so that the buddy keeps nothing; the newer step goes next
            raise _SavedOver(f"step {info.step} was saved over while it was sent")
        _receive(reader)
        return time.perf_counter() - started
