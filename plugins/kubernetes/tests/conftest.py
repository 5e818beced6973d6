"""An emulated Kubernetes cluster (:class:`planaria_kubernetes.testing.EmulatedCluster`: an API
server, a scheduler, and a kubelet that runs pods as processes of this machine, each node in a
network namespace of its own where the machine can), a check after every test that it left
nothing behind, and the training job the end-to-end tests run, with its weights from a run
without a fault."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from planaria.testing.jobs import final_weights, run_planaria, write_job

pytest_plugins = ["planaria.testing.leaks"]
"""After every test: nothing it started still runs, nothing it created is left in /dev/shm."""

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_gpt.py"
STEPS = ["--steps", "24", "--ckpt-every", "4", "--out", "final.pt"]


@pytest.fixture(scope="session")
def train_gpt() -> list[str]:
    """The job's command: examples/train_gpt.py, 24 steps, a checkpoint every 4."""
    return [sys.executable, str(EXAMPLE), *STEPS]


@pytest.fixture(scope="session")
def clean_weights(train_gpt: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The final weights of the job without a fault, on the local scheduler (2 nodes of 1
    worker): what every run that recovers from one must end with, bitwise."""
    pytest.importorskip("torch")
    where = tmp_path_factory.mktemp("clean")
    done = run_planaria(where, "run", str(write_job(where, "k8s-clean", train_gpt)))
    assert done.returncode == 0, done.stdout + done.stderr
    return final_weights(where)


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
