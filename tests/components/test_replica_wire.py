"""Peer replicas over real sockets: a node's saved step copied into a buddy's shared memory,
fetched back by a replacement; what a copy is refused for (a wrong token, an older round,
corrupt bytes, a step saved over while it was sent)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from planaria.checkpoint.replica import (
    ReplicaError,
    ReplicaSender,
    ReplicaServer,
    _connect,
    _receive,
    fetch,
)
from planaria.checkpoint.segment import Segment
from planaria.protocol import ReplicaEndpoint
from planaria.testing.jobs import wait_for

TOKEN = "job-token"


def _save(segment: Segment, step: int, rank: int, world: int, fill: int, size: int) -> None:
    """A worker's save, without torch: ``size`` bytes of ``fill`` and a metadata line."""
    meta = json.dumps({"step": step, "fill": fill}).encode()
    with segment.writing_bytes() as (slot, view):
        view[:size] = bytes([fill]) * size
        segment.publish(slot, step=step, rank=rank, world=world, data_len=size, meta=meta)


def _payload(path: Path, step: int) -> tuple[tuple[int, int], bytes, bytes]:
    segment = Segment.open(path)
    try:
        with segment.reading(step) as info:
            return (info.rank, info.world), bytes(segment.data(info)), bytes(segment.payload(info))
    finally:
        segment.close()


@pytest.fixture
def buddy(tmp_path: Path):
    directory = tmp_path / "buddy"
    directory.mkdir(mode=0o700)
    server = ReplicaServer(directory, TOKEN, "127.0.0.1")
    yield server
    server.close()


def _endpoint(server: ReplicaServer) -> ReplicaEndpoint:
    return ReplicaEndpoint(node_id="buddy", addr="127.0.0.1", port=server.port)


@pytest.fixture(autouse=True)
def private(tmp_path: Path) -> None:
    tmp_path.chmod(0o700)  # shared-memory files live in directories only their user can enter


def test_a_saved_step_goes_to_the_buddy_and_a_replacement_fetches_it_whole(tmp_path, buddy):
    own = Segment.create(tmp_path / "ckpt-0", 1 << 20)
    sender = ReplicaSender(lambda lr: tmp_path / f"ckpt-{lr}", 1, TOKEN, "node-a")
    try:
        _save(own, 7, rank=2, world=4, fill=0xA7, size=300_000)
        buddy.round = 3
        sender.target(_endpoint(buddy), 3)
        holdings = wait_for("the replica", lambda: buddy.holdings(), timeout=10)
        assert [(h.rank, h.world, h.steps, h.source) for h in holdings] == [(2, 4, [7], "node-a")]
        # The next save goes too; the replica keeps both (three slots, as a worker's).
        _save(own, 8, rank=2, world=4, fill=0xA8, size=300_000)
        wait_for("step 8", lambda: buddy.holdings()[0].steps == [8, 7], timeout=10)
    finally:
        sender.close()
        own.close()

    # A replacement copies step 8 into its own segment, as a worker's save of rank 2.
    into = tmp_path / "new" / "ckpt-1"
    into.parent.mkdir(mode=0o700)
    fetch(_endpoint(buddy), TOKEN, rank=2, world=4, step=8, into=into)
    assert _payload(into, 8) == _payload(buddy.path(2), 8)
    placed, data, _ = _payload(into, 8)
    assert placed == (2, 4) and data == bytes([0xA8]) * 300_000

    with pytest.raises(ReplicaError, match="no complete copy of step 5"):
        fetch(_endpoint(buddy), TOKEN, rank=2, world=4, step=5, into=into)
    with pytest.raises(ReplicaError, match="holds rank 2 of 4, not 2 of 8"):
        fetch(_endpoint(buddy), TOKEN, rank=2, world=8, step=8, into=into)
    with pytest.raises(ReplicaError, match="keeps no replica of rank 3"):
        fetch(_endpoint(buddy), TOKEN, rank=3, world=4, step=8, into=into)


def test_a_peer_without_the_jobs_token_is_refused(tmp_path, buddy):
    into = tmp_path / "ckpt-0"
    with pytest.raises(ReplicaError, match="not authorised"):
        fetch(_endpoint(buddy), "another-job", rank=0, world=2, step=1, into=into)
    assert not into.exists()


def test_a_copy_from_an_older_round_is_refused_fencing(tmp_path, buddy):
    buddy.round = 5
    request = {
        "op": "put",
        "round": 4,
        "rank": 0,
        "world": 2,
        "step": 9,
        "data_len": 10,
        "meta_len": 2,
        "capacity": 4096,
        "source": "node-fenced",
    }
    with (
        _connect(_endpoint(buddy), TOKEN, request) as sock,
        pytest.raises(ReplicaError, match="round 4, and this node is in round 5"),
    ):
        _receive(sock.makefile("rb"))
    assert buddy.holdings() == []


def _put(buddy: ReplicaServer, body: bytes, trailer: dict) -> str:
    request = {
        "op": "put",
        "round": 0,
        "rank": 1,
        "world": 2,
        "step": 3,
        "data_len": len(body) - 2,
        "meta_len": 2,
        "capacity": 4096,
        "source": "node-x",
    }
    with _connect(_endpoint(buddy), TOKEN, request) as sock:
        reader = sock.makefile("rb")
        _receive(reader)
        sock.sendall(body)
        sock.sendall(json.dumps(trailer).encode() + b"\n")
        try:
            return str(_receive(reader))
        except ReplicaError as exc:
            return str(exc)


def test_corrupt_bytes_and_a_step_saved_over_while_sent_are_not_kept(buddy):
    import xxhash

    body = b"0123456789{}"
    said = _put(buddy, body, {"xxh3": xxhash.xxh3_64_hexdigest(body + b"!"), "intact": True})
    assert "arrived corrupt" in said
    said = _put(buddy, body, {"xxh3": xxhash.xxh3_64_hexdigest(body), "intact": False})
    assert "changed while it was sent" in said
    assert buddy.holdings() == []
    assert "'ok': True" in _put(
        buddy, body, {"xxh3": xxhash.xxh3_64_hexdigest(body), "intact": True}
    )
    assert [h.steps for h in buddy.holdings()] == [[3]]


def test_a_new_buddy_gets_the_newest_step_at_once_and_the_pace_bounds_the_rate(tmp_path):
    own = Segment.create(tmp_path / "ckpt-0", 4 << 20)
    _save(own, 20, rank=0, world=2, fill=1, size=2_000_000)
    servers = []
    for name in ("one", "two"):
        (tmp_path / name).mkdir(mode=0o700)
        servers.append(ReplicaServer(tmp_path / name, TOKEN, "127.0.0.1"))
    sender = ReplicaSender(
        lambda lr: tmp_path / f"ckpt-{lr}", 1, TOKEN, "node-a", max_bytes_per_second=4e6
    )
    try:
        started = time.monotonic()
        sender.target(_endpoint(servers[0]), 1)
        wait_for("the first copy", lambda: servers[0].holdings(), timeout=10)
        took = time.monotonic() - started
        assert took >= 0.4, took  # 2 MB at 4 MB/s: half a second, not a burst
        # The round changes the buddy (the old one was lost): the newest step goes again,
        # with no new save.
        sender.target(_endpoint(servers[1]), 2)
        wait_for("the copy to the new buddy", lambda: servers[1].holdings(), timeout=10)
        assert servers[1].holdings()[0].steps == [20]
    finally:
        sender.close()
        own.close()
        for server in servers:
            server.close()


def test_an_unreachable_buddy_is_retried_without_stopping_the_sender(tmp_path, buddy):
    own = Segment.create(tmp_path / "ckpt-0", 1 << 20)
    _save(own, 4, rank=0, world=2, fill=9, size=1000)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        nobody = ReplicaEndpoint(node_id="gone", addr="127.0.0.1", port=closed.getsockname()[1])
    sender = ReplicaSender(lambda lr: tmp_path / f"ckpt-{lr}", 1, TOKEN, "node-a")
    try:
        sender.target(nobody, 1)
        time.sleep(0.3)
        assert sender.copies == 0
        sender.target(_endpoint(buddy), 2)
        wait_for("a copy to the reachable buddy", lambda: buddy.holdings(), timeout=10)
    finally:
        sender.close()
        own.close()


def test_a_replica_the_new_ring_no_longer_feeds_is_dropped_after_the_grace(
    tmp_path, buddy, monkeypatch
):
    import planaria.checkpoint.replica as replica

    segments = {}
    for rank in (0, 1):
        segments[rank] = Segment.create(tmp_path / f"ckpt-{rank}", 1 << 16)
        _save(segments[rank], 5, rank=rank, world=2, fill=rank + 1, size=100)
    sender = ReplicaSender(lambda lr: tmp_path / f"ckpt-{lr}", 1, TOKEN, "node-a")
    try:
        sender.target(_endpoint(buddy), 1)  # round 1: this node keeps rank 0's replica
        wait_for("rank 0's replica", lambda: buddy.holdings(), timeout=10)
        # Round 2: the ring changed, rank 1's node sends here now (rank 0's goes elsewhere).
        monkeypatch.setattr(replica, "STALE_AFTER", 0.0)
        buddy.round = 2
        other = ReplicaSender(lambda lr: tmp_path / f"ckpt-{lr + 1}", 1, TOKEN, "node-b")
        try:
            sender.target(None, 2)
            other.target(_endpoint(buddy), 2)
            wait_for(
                "rank 0's replica dropped, rank 1's kept",
                lambda: [h.rank for h in buddy.holdings()] == [1],
                timeout=10,
            )
        finally:
            other.close()
        assert not buddy.path(0).exists() and buddy.path(1).exists()
    finally:
        sender.close()
        for segment in segments.values():
            segment.close()


def test_connections_beyond_the_cap_are_closed_before_they_cost_a_thread(tmp_path, monkeypatch):
    import planaria.checkpoint.replica as replica

    monkeypatch.setattr(replica, "MAX_CONNECTIONS", 1)
    (tmp_path / "capped").mkdir(mode=0o700)
    server = ReplicaServer(tmp_path / "capped", TOKEN, "127.0.0.1")
    try:
        first = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        assert b"nonce" in first.recv(200)  # served: it holds the one slot, saying nothing
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as second:
            assert second.recv(200) == b""  # closed at once
        first.close()
        # The slot is free again once the first is done (its read ends with the close).
        wait_for(
            "a slot",
            lambda: _answered(server.port),
            timeout=15,
        )
    finally:
        server.close()


def _answered(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        return b"nonce" in sock.recv(200)


def test_copies_ride_one_kept_connection_that_is_made_again_when_the_buddy_drops_it(
    tmp_path, buddy, monkeypatch
):
    """A copy every step pays no connection: one connection, proven once, carries them all.
    When the buddy closes it (it sat idle, the buddy restarted), the next copy connects again
    at once, without a failure or a retry pause."""
    from planaria.checkpoint import replica

    own = Segment.create(tmp_path / "ckpt-0", 1 << 20)
    sender = ReplicaSender(lambda lr: tmp_path / f"ckpt-{lr}", 1, TOKEN, "node-a")

    def newest() -> int:
        return next((h.steps[0] for h in buddy.holdings()), -1)

    try:
        buddy.round = 1
        sender.target(_endpoint(buddy), 1)
        for step in range(1, 6):
            _save(own, step, rank=0, world=2, fill=step, size=50_000)
            wait_for(f"step {step}", lambda s=step: newest() == s, timeout=10)
        assert (sender.copies, buddy.accepted) == (5, 1)
        # The buddy ends its connections (idle: its wait for the next request is cut short).
        monkeypatch.setattr(replica, "IDLE", 0.05)
        _save(own, 6, rank=0, world=2, fill=6, size=50_000)
        wait_for("step 6", lambda: newest() == 6, timeout=10)
        time.sleep(0.3)  # the kept connection is closed by now
        started = time.monotonic()
        _save(own, 7, rank=0, world=2, fill=7, size=50_000)
        wait_for("step 7", lambda: newest() == 7, timeout=10)
        assert time.monotonic() - started < 0.9  # not after the 1 s pause of a failed copy
        assert buddy.accepted == 2 and sender.copies == 7
    finally:
        sender.close()
        own.close()
