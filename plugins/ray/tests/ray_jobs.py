"""The Ray plugin's job tests' helpers: a job on the session's Ray cluster, a run paused
mid-training for a fault from outside, and what it printed once it ended."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from planaria.testing import jobs
from planaria.testing.jobs import (
    bind_every_interface,
    write_job,
)
from planaria_ray.testing import AGENT, LocalCluster

ROOT = Path(__file__).resolve().parents[3]


EXAMPLE = ROOT / "examples" / "train_gpt.py"


STEPS = ["--steps", "24", "--ckpt-every", "4", "--out", "final.pt"]


def job(where: Path, scheduler: dict[str, Any] | None = None, **job: object) -> Path:
    """The job; on Ray, its master bound to every interface, with no ``master.advertise``:
    the nodes are hosts of their own (:mod:`planaria_ray.testing`), which reach the master at
    the address it finds towards them."""
    path = write_job(where, "ray-e2e", [sys.executable, str(EXAMPLE), *STEPS], scheduler, **job)
    return path if scheduler is None else bind_every_interface(path)


def on_ray(address: str, **options: object) -> dict[str, Any]:
    return {
        "backend": "ray",
        "options": {"address": address, "resources": AGENT, "stop_grace": "1s", **options},
    }


@contextlib.contextmanager
def paused_run(where: Path, config: Path, cluster: LocalCluster) -> Iterator[subprocess.Popen[str]]:
    """:func:`planaria.testing.jobs.paused_run`; at the end the cluster gets a new Ray node for
    the one the block took, and keeps its size for the tests after this one."""
    try:
        with jobs.paused_run(where, config) as run:
            yield run
    finally:
        cluster.add_node()


def finished(run: subprocess.Popen) -> str:
    """What ``run`` printed, once it ended, without the raylet logs Ray's driver prints for a
    raylet that died (long lines that would push the job's own end out of a report)."""
    output, _ = run.communicate(timeout=240)
    return "\n".join(line for line in output.splitlines() if "[state-dump]" not in line)
