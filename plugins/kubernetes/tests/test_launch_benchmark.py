"""benchmarks/kubernetes_launch.py runs as a user runs it, short: it reaches into the
scheduler's launch path, so a change there that breaks it fails here rather than when someone
next measures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "kubernetes_launch.py"


def test_the_launch_benchmark_creates_the_pods_both_ways_and_prints_its_figures() -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH), "--pods", "12", "--parallelism", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["pods"] == 12 and figures["parallelism"] == 4
    assert figures["serial_s"] > 0 and figures["parallel_s"] > 0
    # The speedup is the ratio of the two times: the printed times are rounded to the ms (and
    # the speedup to 0.01), so it lies between the ratios of their ends.
    serial, parallel, half_ms = figures["serial_s"], figures["parallel_s"], 0.0005
    assert parallel > half_ms, figures
    low = (serial - half_ms) / (parallel + half_ms) - 0.005
    high = (serial + half_ms) / (parallel - half_ms) + 0.005
    assert low <= figures["speedup"] <= high, figures
