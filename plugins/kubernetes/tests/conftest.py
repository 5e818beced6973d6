"""An emulated Kubernetes cluster (:class:`planaria_kubernetes.testing.EmulatedCluster`: an API
server on loopback, a scheduler, and a kubelet that runs pods as processes of this machine), and
a check after every test that it left nothing behind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["planaria.testing.leaks"]
"""After every test: nothing it started still runs, nothing it created is left in /dev/shm."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed job test shows each run's timeline and the agents' logs (a flake on a loaded
    machine leaves nothing else)."""
    report = yield
    where = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when == "call" and report.failed and isinstance(where, Path):
        for path in sorted(where.glob("planaria-runs/*/events.jsonl")):
            lines = path.read_text().splitlines()[-80:]
            report.sections.append((f"timeline {path.parent.name}", "\n".join(lines)))
        for path in sorted(where.glob("planaria-runs/*/logs/*.log")):
            report.sections.append((f"log {path.name}", path.read_text()[-3000:]))
    return report
