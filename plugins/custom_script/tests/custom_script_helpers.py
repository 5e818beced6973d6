"""Helpers for the custom_script tests: run a check, and see which processes still live.

A uniquely named module, not ``conftest``, so that it can be imported next to other suites.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from planaria.health.api import CheckContext, DeviceResult
from planaria.process import running
from planaria_custom_script import CustomScriptCheck, CustomScriptOptions

MakeScript = Callable[..., Path]


def make_check(context: CheckContext, path: Path, **options: Any) -> CustomScriptCheck:
    return CustomScriptCheck(CustomScriptOptions(path=path, **options), context)


def run_script(context: CheckContext, path: Path, **options: Any) -> list[DeviceResult]:
    return make_check(context, path, **options).run()


def wait_dead(pids: Iterable[int], within: float = 2.0) -> list[int]:
    """The pids still alive after ``within`` seconds (SIGKILL is delivered asynchronously)."""
    pending = list(pids)
    deadline = time.monotonic() + within
    while pending and time.monotonic() < deadline:
        pending = [pid for pid in pending if running(pid)]
        if pending:
            time.sleep(0.02)
    return [pid for pid in pending if running(pid)]


def read_pids(directory: Path, within: float = 5.0, count: int = 1) -> dict[str, int]:
    """Pid files ``<name>`` in ``directory``, waiting until ``count`` of them are complete."""
    deadline = time.monotonic() + within
    while True:
        pids = {
            p.name: int(p.read_text()) for p in directory.iterdir() if p.read_text().endswith("\n")
        }
        if len(pids) >= count or time.monotonic() > deadline:
            return pids
        time.sleep(0.02)
