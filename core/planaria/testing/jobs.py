"""Helpers for a scheduler plugin's end-to-end tests: run ``planaria`` as a user does, read
the job's timeline and its final weights, wait for something to happen. The Slurm and Ray
plugins' job tests share them; a third-party scheduler's tests can too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


def run_planaria(
    where: Path, *args: str, timeout: float = 240, env: Mapping[str, str] | None = None
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
