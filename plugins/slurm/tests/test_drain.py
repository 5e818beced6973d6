"""``drain: true``: a node the job excludes as bad is drained in Slurm, with planaria's reason,
so that no other job lands on it either (the cluster's operator resumes it)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from conftest import slurm
from planaria_slurm import SlurmOptions, SlurmScheduler
from planaria_slurm import state as remembered

from planaria.plugin import LaunchSpec, NodeState


def test_an_excluded_node_is_drained_with_the_reason(allocation: str, tmp_path: Path) -> None:
    scheduler = SlurmScheduler(
        SlurmOptions(
            job_id=allocation, drain=True, state_dir=tmp_path, stop_grace=0.5, watch_interval=0.5
        )
    )
    spec = LaunchSpec(job="drain", command=(sys.executable, "-c", "import time; time.sleep(600)"))
    host = ""
    try:
        (handle,) = scheduler.launch(spec, 1)
        host = handle.host
        deadline = time.monotonic() + 60
        running = False
        while not running and time.monotonic() < deadline:
            running = any(e.state is NodeState.RUNNING for e in scheduler.poll(1.0))
        assert running, "the node's step never ran"
        new = scheduler.replace(handle.node_id, exclude_host=True)
        assert new.host != host
        assert host in scheduler.excluded_hosts()
        state, _, reason = (
            slurm("sinfo", "-h", "-N", "-n", host, "-o", "%T|%E").stdout.strip().partition("|")
        )
        assert state.startswith("drain"), state  # draining while its old step ends, then drained
        assert reason.startswith("planaria: "), reason
        assert host in remembered.load(tmp_path)  # and a later submission excludes it
    finally:
        scheduler.stop()
        if host:
            slurm("scontrol", "update", f"nodename={host}", "state=resume", check=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                now = slurm("sinfo", "-h", "-N", "-n", host, "-o", "%T").stdout.strip()
                if now in ("idle", "mixed", "allocated"):
                    break
                time.sleep(0.2)
