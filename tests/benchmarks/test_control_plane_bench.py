"""benchmarks/control_plane.py runs end to end: simulated agents register with a real master,
form a round, heart-beat, go through a restart round and a node replacement, and the figures
come out. A small N: the targets themselves are the benchmark's to show, not a test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "control_plane.py"


@pytest.mark.slow
def test_the_control_plane_benchmark_goes_through_every_phase(tmp_path):
    bench = subprocess.Popen(
        [sys.executable, str(BENCH), "--agents", "8", "20", "--beat-window", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        stdout, stderr = bench.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        bench.terminate()  # SIGTERM: the benchmark stops its masters on the way out
        stdout, stderr = bench.communicate(timeout=60)
        pytest.fail(f"the benchmark did not end within 240 s:\n{stdout}\n{stderr}")
    assert bench.returncode == 0, stdout + stderr
    lines = stdout.strip().splitlines()
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    *each, last = rows
    assert [r["agents"] for r in each] == [8, 20]
    assert set(last) == {
        "agents",
        "round_s",
        "round_read_s",
        "restart_round_s",
        "restart_round_read_s",
        "action_all_ms",
        "action_read_all_ms",
        "master_push_ms",
        "push_floor_write_ms",
        "push_floor_all_ms",
        "heartbeat_p99_ms",
        "after_round_p99_ms",
        "master_cpu_per_s",
        "master_rss_mib",
    }
    assert last["agents"] == 20
    for row in each:
        # Every phase ended: each figure is a measured time, and beats came in.
        assert row["round_s"] >= 0 and row["restart_round_s"] > 0
        # The ready read off each connection before the agent's code had it.
        assert 0 <= row["round_read_s"] <= row["round_s"]
        assert 0 < row["restart_round_read_s"] <= row["restart_round_s"]
        # The restart was pushed: it reached every agent, after the master decided it.
        assert 0 < row["action_p50_ms"] <= row["action_all_ms"] < row["restart_round_s"] * 1000
        # Its frame was read off each agent's connection before that agent's code had it.
        assert 0 < row["action_read_p50_ms"] <= row["action_read_all_ms"] <= row["action_all_ms"]
        # The master's own side of a push burst, from its metrics (a few ms at this size).
        assert 0 <= row["master_push_ms"] < row["restart_round_s"] * 1000
        # Its floor, measured in the same run: N plain messages written and read.
        assert row["push_floor_write_ms"] > 0 and row["push_floor_all_ms"] > 0
        assert row["replace_total_s"] >= row["replace_s"] > 0
        # The heartbeat timeout (5 s) comes first, counted from the last beat (1 s apart).
        assert row["replace_total_s"] >= 4.0
        assert row["heartbeats_per_s"] > 0 and row["master_rss_mib"] > 0
    assert "ms/agent round" in stdout  # the growth table
