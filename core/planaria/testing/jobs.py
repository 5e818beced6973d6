"""Helpers for a scheduler plugin's end-to-end tests: write a job file, run ``planaria`` as a
user does (also with rank 0 paused mid-training, for a fault to land on), read the job's
timeline and its final weights, wait for something to happen. The Slurm, Ray and Kubernetes
plugins' job tests share them; a third-party scheduler's tests can too."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

T = TypeVar("T")


def bind_every_interface(path: Path) -> Path:
    """Have the job file's master listen on every interface (``master.host: 0.0.0.0``, no
    ``master.advertise``): for nodes that are hosts of their own, which reach it at the address
    the master finds towards them (:mod:`planaria.master.advertise`)."""
    config = yaml.safe_load(path.read_text())
    config.setdefault("master", {})["host"] = "0.0.0.0"
    path.write_text(yaml.safe_dump(config))
    return path


def run_planaria(
    where: Path, *args: str, timeout: float = 600, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m planaria ARGS`` in ``where``, its output captured (wide, for tables)."""
    return subprocess.run(
        [sys.executable, "-m", "planaria", *args],
        cwd=where,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_job(
    where: Path,
    name: str,
    command: Sequence[str],
    scheduler: Mapping[str, Any] | None = None,
    /,
    **job: object,
) -> Path:
    """``where/job.yaml``: a job of 2 nodes of 1 worker running ``command``, 3 restarts, fast
    joins and heartbeats, no health checks; ``job`` overrides the ``job`` section (its
    ``command`` too) and ``scheduler`` is the ``scheduler`` section (none: the local one)."""
    config: dict[str, object] = {
        "job": {
            "name": name,
            "command": list(command),
            "nodes": 2,
            "procs_per_node": 1,
            "max_restarts": 3,
            **job,
        },
        "rendezvous": {"join_grace": "2s", "join_timeout": "90s"},
        "master": {"heartbeat_interval": "1s", "heartbeat_timeout": "15s"},
        "diagnosis": {"checks": [], "preflight": False},
    }
    if scheduler is not None:
        config["scheduler"] = dict(scheduler)
    path = where / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def paused_run(where: Path, config: Path, at_step: int = 10) -> Iterator[subprocess.Popen[str]]:
    """``planaria run`` of ``config`` in ``where``, rank 0 stopping itself (SIGSTOP, chaos
    ``stop_worker``) at ``at_step`` of the first attempt, so that a fault from outside lands
    mid-training; entered once it did. Its output is one pipe (stdout and stderr). At the end
    a run still going is interrupted."""
    chaos = ["--set", f'chaos=[{{"kind": "stop_worker", "rank": 0, "at_step": {at_step}}}]']
    run = subprocess.Popen(
        [sys.executable, "-m", "planaria", "run", str(config), *chaos],
        cwd=where,
        env={**os.environ, "COLUMNS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def paused() -> bool:
            logs = where.glob("planaria-runs/*/logs/*.log")
            return any("stop_worker" in p.read_text() for p in logs)

        wait_for(f"rank 0 pausing at step {at_step}", paused)
        yield run
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
            run.communicate(timeout=60)


def job_events(where: Path) -> list[dict[str, Any]]:
    """Every event of every run under ``where`` (their ``events.jsonl``)."""
    found: list[dict[str, Any]] = []
    for timeline in where.glob("planaria-runs/*/events.jsonl"):
        found += [json.loads(line) for line in timeline.read_text().splitlines()]
    return found


def final_weights(where: Path) -> dict[str, Any]:
    """The ``final.pt`` that ``examples/train_gpt.py`` saved in ``where`` (needs torch)."""
    import torch

    (path,) = where.glob("final.pt")
    loaded: dict[str, Any] = torch.load(path, weights_only=True, map_location="cpu")
    return loaded


def wait_for(
    what: str, predicate: Callable[[], T], timeout: float = 120.0, every: float = 0.2
) -> T:
    """The first true value of ``predicate()``; the test fails naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout:g}s")
        time.sleep(every)
