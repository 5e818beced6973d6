"""A master that was itself stopped does not condemn the nodes it could not hear.

``kill -STOP`` the ``planaria run`` process for longer than the heartbeat timeout during a
2-node job, then ``kill -CONT``: the heartbeats queued on its sockets are the nodes' proof of
life, so no node is lost and no worker restarts; training went on meanwhile.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from planaria.testing.jobs import EXAMPLE, events, job, start

pytest.importorskip("torch")

STALL = 20.0  # longer than the 15 s heartbeat timeout


def rank0_steps(tmp_path: Path) -> list[int]:
    logs = list(tmp_path.glob("planaria-runs/*/logs/rank-0.log"))
    if not logs:
        return []
    return [int(s) for s in re.findall(r"^step (\d+)", logs[0].read_text(), re.M)]


@pytest.mark.slow
def test_a_stopped_master_costs_no_restart(tmp_path, mark):
    command = [sys.executable, str(EXAMPLE), "--steps", "100000", "--ckpt-every", "50"]
    config = job(tmp_path, master={"heartbeat_interval": "1s", "heartbeat_timeout": "15s"})
    master = start(tmp_path, mark, str(config), "--set", f"job.command={json.dumps(command)}")
    try:
        deadline = time.monotonic() + 120
        while len(rank0_steps(tmp_path)) < 20:
            assert master.poll() is None and time.monotonic() < deadline, "training never began"
            time.sleep(0.2)
        master.send_signal(signal.SIGSTOP)
        before = rank0_steps(tmp_path)[-1]
        time.sleep(STALL)
        during = rank0_steps(tmp_path)[-1]
        master.send_signal(signal.SIGCONT)
        time.sleep(8)  # long enough for a wrongly condemned node to be replaced
        assert master.poll() is None, master.communicate()[0]
        master.send_signal(signal.SIGINT)  # stop the endless job
        output, _ = master.communicate(timeout=120)
    finally:
        if master.poll() is None:
            master.send_signal(signal.SIGCONT)
            master.kill()
            master.wait()
    assert during > before, "training should go on while the master is stopped"
    timeline = events(tmp_path)
    kinds = [e["kind"] for e in timeline]
    assert "fault_detected" not in kinds, output
    assert "node_replaced" not in kinds, output
    assert "workers_restarted" not in kinds, output
    (stalled,) = [e for e in timeline if e["kind"] == "master_stalled"]
    assert stalled["data"]["seconds"] >= STALL - 1
    stopped = [e for e in timeline if e["kind"] == "job_stopped"]
    assert [e["data"]["cause"] for e in stopped] == ["interrupted"]
