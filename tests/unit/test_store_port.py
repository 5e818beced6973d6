"""The port an agent gives torch.distributed's store: below the kernel's ephemeral range (where
no outgoing connection can take it before the store binds it), and free to bind."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from planaria.agent import address
from planaria.agent.address import STORE_PORTS_LOW, free_port

EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def test_the_store_port_is_below_the_ephemeral_range_and_free() -> None:
    low = int(EPHEMERAL.read_text().split()[0])
    if low <= STORE_PORTS_LOW:
        pytest.skip(f"this machine's ephemeral range starts at {low}")
    for _ in range(20):
        port = free_port("127.0.0.1")
        assert STORE_PORTS_LOW <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_something_listens_at_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken, socket.socket() as probe:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
        probe.close()
        tries: Iterator[int] = iter([busy, busy, free])
        monkeypatch.setattr(address.random, "randrange", lambda *_: next(tries))
        assert free_port("127.0.0.1") == free


def test_with_no_room_below_the_ephemeral_range_the_kernel_picks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text("1024\t60999\n")
    monkeypatch.setattr(address, "_EPHEMERAL", narrow)
    monkeypatch.setattr(address.random, "randrange", lambda *_: pytest.fail("no range to pick"))
    port = free_port("127.0.0.1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
