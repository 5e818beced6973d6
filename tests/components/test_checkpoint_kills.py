"""A save under pressure: a worker killed mid-save while the persister holds a slot, a persist at
fault racing the commit of the same step, and a persister that stops answering."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from planaria import process  # noqa: E402
from planaria.agent.checkpoints import NodeCheckpoints  # noqa: E402
from planaria.checkpoint import Checkpointer, persister  # noqa: E402
from planaria.checkpoint.env import SEGMENT_ENV, SOCKET_ENV, STORAGE_ENV  # noqa: E402
from planaria.checkpoint.segment import WRITING, Segment  # noqa: E402
from planaria.protocol import CheckpointSpec  # noqa: E402
from planaria.shm import make_temp_dir, remove_dir  # noqa: E402
from support.checkpoints import Node, answered, ask, partials, send, store_at  # noqa: E402

BIG = 16 << 20
"""Elements of a state whose save lasts long enough to be caught in the middle (64 MiB)."""


@pytest.fixture(autouse=True)
def standalone(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PLANARIA_CKPT_") or name in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)


def test_a_kill_mid_save_while_the_persister_holds_a_slot_restores_the_newest_step(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = node.worker(0, 1)
    path = node.directory / "ckpt-0"
    assert ask(worker, f"save 1 {BIG} 0") == "saved 1"
    segment = Segment.open(path)
    try:
        pinned = segment.pin(1)  # as the persister does while it writes step 1 to storage
        assert ask(worker, f"save 2 {BIG} 0") == "saved 2"
        newest = 2  # the newest complete step
        for step in range(3, 9):
            send(worker, f"save {step} {BIG} 0")
            deadline = time.monotonic() + 60
            while not any(i.state == WRITING for i in segment.infos()):
                # A save done before this loop saw it (descheduled meanwhile): the next one.
                if (reply := answered(worker)) is not None:
                    assert reply == f"saved {step}", reply
                    newest = step
                    break
                assert time.monotonic() < deadline, "the save never started"
            else:
                break
        else:
            pytest.fail("no save was caught in the middle of its copy")
        os.kill(worker.pid, signal.SIGKILL)  # mid-copy of the save after the newest
        worker.wait()
        assert segment.valid()[0].step == newest
        segment.unpin(pinned)
    finally:
        segment.close()
    # A restarted worker restores the newest step from memory, whole.
    monkeypatch.setenv(SOCKET_ENV, str(node.socket))
    monkeypatch.setenv(SEGMENT_ENV, str(path))
    monkeypatch.setenv(STORAGE_ENV, json.dumps(node.spec))
    restarted = Checkpointer()
    try:
        state = {"w": torch.zeros(BIG)}
        restored = restarted.load(state)
        assert restored is not None and restored[0] == newest
        assert restarted.restored_from == "memory"
        assert torch.equal(state["w"], torch.full((BIG,), float(newest)))
    finally:
        restarted.close()


def _persist_at_fault(node: Node, step: int) -> list[str]:
    """What the agent does at a fault: pin the step through its own connection and wait."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(node.socket))
        with sock.makefile("rb") as reader:
            hello = {"op": "hello", "segment": str(node.directory / "ckpt-0")}
            persister.ask(sock, reader, hello, "ready")
            persister.ask(sock, reader, {"op": "persist", "step": step}, "pinned")
            errors: list[str] = persister.ask(sock, reader, {"op": "wait"}, "idle")["errors"]
            return errors


def test_a_persist_at_fault_of_a_step_being_committed_joins_it(node: Node, tmp_path: Path) -> None:
    node.start()
    worker = node.worker(0, 1)
    for step in range(1, 5):
        assert ask(worker, f"save {step} {4 << 20} 1") == f"saved {step}"
        # The worker's persist of the step is being written and then committed meanwhile.
        assert _persist_at_fault(node, step) == [], step
        assert ask(worker, "wait") == "idle"
    assert store_at(tmp_path / "ckpt").committed_steps() == [4, 3, 2]
    assert partials(tmp_path / "ckpt") == []


def _alive(pid: int) -> bool:
    return process.running(pid)


def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped (the signal is delivered
    asynchronously: a thread could still answer a request meanwhile)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    tasks = Path(f"/proc/{pid}/task")
    while True:
        states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()]
        if all(state in ("T", "t") for state in states):
            return
        assert time.monotonic() < deadline, states
        time.sleep(0.001)


@pytest.mark.slow
def test_a_stopped_standalone_persister_costs_a_save_at_most_its_timeout_and_is_replaced(
    tmp_path: Path,
) -> None:
    ckpt = Checkpointer(tmp_path / "ckpt", persister_timeout=1.0)
    old = None
    try:
        ckpt.save(1, {"w": torch.full((1024,), 1.0)}, persist=True)
        ckpt.wait()
        assert ckpt._persister.process is not None
        old = ckpt._persister.process.pid
        stop(old)  # its storage hangs, as NFS does
        started = time.monotonic()
        ckpt.save(2, {"w": torch.full((1024,), 2.0)}, persist=True)
        blocked = time.monotonic() - started
        assert blocked < 1.0 + 1.0, blocked
        assert not _alive(old)  # killed; its locks went with it
        ckpt.save(3, {"w": torch.full((1024,), 3.0)}, persist=True)
        ckpt.wait()
        assert ckpt._persister.process is not None and ckpt._persister.process.pid != old
        assert store_at(tmp_path / "ckpt").committed_steps()[:2] == [3, 2]
    finally:
        if old is not None and _alive(old):
            os.kill(old, signal.SIGCONT)
            os.kill(old, signal.SIGKILL)
        ckpt.close()
    assert old is not None and not _alive(old)


@pytest.mark.slow
def test_a_stopped_node_persister_is_replaced_with_an_event_and_saves_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = {"backend": "local", "options": {"path": str(tmp_path / "ckpt")}}
    spec = CheckpointSpec(storage=storage, persister_timeout=1.0)
    directory = make_temp_dir("planaria-test-")
    seen: list[dict[str, Any]] = []
    node = NodeCheckpoints(spec, directory, seen.append)
    node.start()
    for name, value in node.worker_env(0, "storage", 0).items():
        monkeypatch.setenv(name, value)
    ckpt = Checkpointer()
    old = None
    try:
        ckpt.save(1, {"w": torch.full((1024,), 1.0)}, persist=True)
        ckpt.wait()
        assert node._process is not None
        old = node._process.pid
        stop(old)
        started = time.monotonic()
        ckpt.save(2, {"w": torch.full((1024,), 2.0)}, persist=True)
        blocked = time.monotonic() - started
        assert blocked < 1.0 + 1.0, blocked
        deadline = time.monotonic() + 30
        while not [e for e in seen if e.get("event") == "persister_restarted"]:
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
        (restarted,) = [e for e in seen if e.get("event") == "persister_restarted"]
        assert "stopped answering for 1s" in restarted["error"]
        assert not _alive(old)
        while not node.sync(1.0):  # the new one serves
            assert time.monotonic() < deadline
        ckpt.save(3, {"w": torch.full((1024,), 3.0)}, persist=True)
        ckpt.wait()
        assert store_at(tmp_path / "ckpt").committed_steps()[:2] == [3, 2]
    finally:
        if old is not None and _alive(old):
            os.kill(old, signal.SIGCONT)
            os.kill(old, signal.SIGKILL)
        ckpt.close()
        node.stop()
        remove_dir(directory)
    assert node._process is not None and node._process.poll() is not None
