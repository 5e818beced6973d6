"""The workers' store on the master's host (``rendezvous.store: master``): a real store host
process serving real TCPStores, a fresh one per round; it dies with the master however the
master ends."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import pytest

torch = pytest.importorskip("torch")

from torch.distributed import TCPStore  # noqa: E402

from planaria.master.store import StoreHost  # noqa: E402

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]


def _soon(what: str, get: Callable[[], T | None], within: float = 60.0) -> T:
    deadline = time.monotonic() + within
    while (found := get()) is None:
        assert time.monotonic() < deadline, f"{what} within {within:g}s"
        time.sleep(0.05)
    return found


def _client(port: int) -> TCPStore:
    return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


@pytest.fixture
def host(tmp_path: Path) -> Iterator[StoreHost]:
    found = StoreHost("127.0.0.1", tmp_path / "logs" / "store.log")
    found.start()
    yield found
    pid = found.pid
    found.close()
    assert pid is None or _gone(pid)


def test_each_round_gets_a_fresh_store_and_the_one_before_closes(host: StoreHost) -> None:
    addr, first = _soon("a store for round 1", lambda: host.take(1))
    assert addr == "127.0.0.1"
    one = _client(first)
    one.set("init/", "round one's key")
    assert one.get("init/") == b"round one's key"

    addr, second = _soon("a store for round 2", lambda: host.take(2))
    assert second != first
    two = _client(second)
    assert not two.check(["init/"])  # nothing of round 1 in round 2's store
    two.set("k", "v")
    _soon("round 1's store closed", lambda: True if not _listening(first) else None, 10.0)
    assert two.get("k") == b"v"  # the round's store stays up while it runs
    assert _listening(second)


def test_a_store_host_that_died_is_started_again(host: StoreHost) -> None:
    _soon("a store for round 1", lambda: host.take(1))
    pid = host.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    _, port = _soon("a store for round 2", lambda: host.take(2))  # waits for a new host
    assert host.pid != pid
    store = _client(port)
    store.set("k", "v")
    assert store.get("k") == b"v"


PARENT = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from planaria.master.store import StoreHost

    host = StoreHost("127.0.0.1", Path(sys.argv[1]))
    host.start()
    while (store := host.take(1)) is None:
        time.sleep(0.05)
    # A child forked without exec keeps the pipe to the store host open after this one dies.
    holder = os.fork() if sys.argv[2] == "hold" else None
    if holder == 0:
        time.sleep(120)
        os._exit(0)
    print(json.dumps({"host": host.pid, "holder": holder, "port": store[1]}), flush=True)
    time.sleep(120)
    """
)


@pytest.mark.parametrize("pipe", ["closes", "hold"])
def test_the_store_host_dies_with_the_master_killed(tmp_path: Path, pipe: str) -> None:
    """Its input's end tells it; where another process holds the pipe, its parent's end."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "core"), *sys.path])}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "store.log"), pipe],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    holder = None
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line, f"the parent exited: {parent.wait()}"
        pids = json.loads(line)
        holder = pids["holder"]
        assert _listening(pids["port"])
        parent.kill()
        parent.wait()
        _soon(
            "the store host gone, its store closed",
            lambda: True if _gone(pids["host"]) and not _listening(pids["port"]) else None,
            10.0,
        )
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if holder is not None:
            os.kill(holder, signal.SIGKILL)
