"""A harness for the local scheduler's tests: node programs that write down their pids, and a
fixture that stops every scheduler it made and checks that no node process outlived it."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from planaria.process import processes, running
from planaria.scheduler.api import LaunchSpec
from planaria.scheduler.local import LocalOptions, LocalScheduler


def our_children() -> list[int]:
    return [pid for pid, stat in processes() if stat.ppid == os.getpid()]


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


class Harness:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.piddir = tmp_path / "pids"
        self.piddir.mkdir()
        self.schedulers: list[LocalScheduler] = []

    def scheduler(self, **options: object) -> LocalScheduler:
        scheduler = LocalScheduler(LocalOptions.model_validate(options))
        self.schedulers.append(scheduler)
        return scheduler

    def spec(self, code: str, env: dict[str, str] | None = None, **extra: object) -> LaunchSpec:
        command = (sys.executable, "-c", PRELUDE + textwrap.dedent(code))
        full_env = {"PIDDIR": str(self.piddir), **(env or {})}
        return LaunchSpec.model_validate({"job": "t", "command": command, "env": full_env, **extra})

    def pid(self, node_id: str, name: str | None = None) -> int:
        path = self.piddir / f"{node_id}{'.' + name if name else ''}.pid"
        wait_for(path.exists)
        return int(path.read_text())

    def all_pids(self) -> list[int]:
        return [int(p.read_text()) for p in self.piddir.glob("*.pid")]


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    yield h
    for scheduler in h.schedulers:
        scheduler.stop()
    assert our_children() == [], "a node process outlived stop()"
    # Orphaned helpers are reaped by whoever adopted them: give that a moment.
    wait_for(lambda: not any(running(pid) for pid in h.all_pids()), timeout=2.0)


PRELUDE = """\
import os, pathlib, sys, time
def note_pid(name=None, pid=None):
    node = os.environ["PLANARIA_NODE_ID"]
    path = pathlib.Path(os.environ["PIDDIR"], node + ("." + name if name else "") + ".pid")
    path.with_suffix(".tmp").write_text(str(pid or os.getpid()))
    path.with_suffix(".tmp").rename(path)
note_pid()
node = os.environ["PLANARIA_NODE_ID"]
"""
