"""Helpers of the flash-checkpoint tests: compare state trees, open a persisted store, play a
node's persister and its managed workers."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import torch

from planaria.checkpoint import persister
from planaria.checkpoint.env import KEEP_LAST_ENV, SEGMENT_ENV, SOCKET_ENV, STORAGE_ENV
from planaria.checkpoint.persisted import PersistedCheckpoints
from planaria.shm import make_temp_dir, name_prefix, remove_dir
from planaria.storage.local import LocalStorage, LocalStorageOptions


def equal_trees(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal_trees(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        same = type(a) is type(b) and len(a) == len(b)
        return same and all(equal_trees(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b) and type(a) is type(b)


def store_at(path: Path) -> PersistedCheckpoints:
    return PersistedCheckpoints(LocalStorage(LocalStorageOptions(path=path)))


def partials(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("*.partial"))


class Node:
    """What an agent does for the flash checkpoint, done by the test: a persister serving
    managed workers (``Checkpointer()`` under ``planaria run``'s environment)."""

    def __init__(self, tmp_path: Path, storage: Path, keep_last: int = 3) -> None:
        self.directory = make_temp_dir(name_prefix() + "test-")  # the node's private directory
        self.socket = self.directory / "sock"
        self.spec = {"backend": "local", "options": {"path": str(storage)}}
        self.keep_last = keep_last
        self.tmp_path = tmp_path
        self.process: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[str]] = []

    def start(self, *extra: str) -> None:
        argv = persister.command(self.socket, self.spec, self.keep_last, str(self.directory))
        self.process = subprocess.Popen([*argv, *extra], stdout=subprocess.PIPE)
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == b"ready"

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def worker(self, rank: int, world: int) -> subprocess.Popen[str]:
        env = {
            **os.environ,
            SOCKET_ENV: str(self.socket),
            SEGMENT_ENV: str(self.directory / f"ckpt-{rank}"),
            STORAGE_ENV: json.dumps(self.spec),
            KEEP_LAST_ENV: str(self.keep_last),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
        }
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.workers.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.workers:
            with contextlib.suppress(OSError):
                proc.kill()
            proc.wait()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(60)
        remove_dir(self.directory)


def ask(worker: subprocess.Popen[str], line: str, timeout: float = 60) -> str:
    """Send one line to a worker; its answer (its log lines, also on stdout, are skipped)."""
    assert worker.stdin is not None and worker.stdout is not None
    answers = _answers(worker)
    worker.stdin.write(line + "\n")
    worker.stdin.flush()
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            answer = answers.get(timeout=left)
        except queue.Empty:
            break
        if answer is None:
            raise EOFError(f"the worker exited ({worker.wait()}) instead of answering {line!r}")
        if answer.split(" ", 1)[0] in ("saved", "idle", "error"):
            return answer
    raise TimeoutError(f"no answer to {line!r} within {timeout:g}s")


WORKER = textwrap.dedent(
    """
    import sys, torch
    from planaria.checkpoint import Checkpointer
    ckpt = Checkpointer()
    for line in sys.stdin:
        op, *args = line.split()
        try:
            if op == "save":  # save STEP ELEMENTS PERSIST
                step, n, persist = int(args[0]), int(args[1]), args[2] == "1"
                ckpt.save(step, {"w": torch.full((n,), float(step))}, persist=persist)
                print("saved", step, flush=True)
            elif op == "wait":
                ckpt.wait()
                print("idle", flush=True)
        except Exception as exc:
            print("error", type(exc).__name__, exc, flush=True)
    ckpt.close()
    """
)


def send(worker: subprocess.Popen[str], line: str) -> None:
    """Send one line to a worker, its answer to be read with :func:`answered`."""
    assert worker.stdin is not None
    _answers(worker)
    worker.stdin.write(line + "\n")
    worker.stdin.flush()


def answered(worker: subprocess.Popen[str]) -> str | None:
    """The worker's answer, if one came (its log lines skipped); None if none yet."""
    answers = _answers(worker)
    while True:
        try:
            answer = answers.get_nowait()
        except queue.Empty:
            return None
        if answer is None:
            raise EOFError(f"the worker exited ({worker.wait()})")
        if answer.split(" ", 1)[0] in ("saved", "idle", "error"):
            return answer


def _answers(worker: subprocess.Popen[str]) -> queue.Queue[str | None]:
    if worker.pid not in _queues:
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            assert worker.stdout is not None
            for text in worker.stdout:
                lines.put(text.strip())
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        _queues[worker.pid] = lines
    return _queues[worker.pid]


_queues: dict[int, queue.Queue[str | None]] = {}
