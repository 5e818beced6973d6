"""benchmarks/goodput_sim.py run as a user runs it, on a short horizon: its JSON line, its
determinism, where its figures come from, and that the model answers planaria's MTTR."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIM = ROOT / "benchmarks" / "goodput_sim.py"


def sim(*args: str) -> tuple[dict, str]:
    result = subprocess.run(
        [sys.executable, str(SIM), "--days", "6", "--trials", "3", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.splitlines()[-1]), result.stdout


def test_the_last_line_is_the_figures_and_a_seed_gives_the_same_ones():
    figures, text = sim("--seed", "3")
    assert figures["gpus"] == 16384
    for key in ("planaria_effective", "torchrun_effective"):
        assert 0 < figures[key] < 1
    assert figures["planaria_effective"] > figures["torchrun_effective"]
    assert sim("--seed", "3") == (figures, text)
    assert "Llama 3 report" in text and "docs/reliability.md" in text


def test_planaria_gains_when_its_restarts_are_faster():
    slow, _ = sim("--set", "crash_restart_s=300", "--set", "node_replace_s=300")
    fast, _ = sim("--set", "crash_restart_s=0.1", "--set", "node_replace_s=1")
    assert fast["planaria_effective"] > slow["planaria_effective"]
    assert fast["torchrun_effective"] == slow["torchrun_effective"]  # the baseline is its own


def test_measured_figures_are_taken_from_a_benchmark_line(tmp_path):
    rows = [
        {"fault": "worker-exception", "survived": True, "recovery_s": 200.0, "steps_lost": 0},
        {"fault": "agent-sigkill", "survived": True, "recovery_s": 300.0, "steps_lost": 1},
    ]
    path = tmp_path / "faults.out"
    path.write_text("a table\n" + json.dumps({"faults": rows, "all_passed": True}) + "\n")
    measured, text = sim("--measured", str(path))
    default, _ = sim()
    assert f"worker-exception recovery in {path}" in text
    assert measured["planaria_effective"] < default["planaria_effective"]


def test_bad_input_is_named(tmp_path):
    empty = tmp_path / "empty.out"
    empty.write_text("no json here\n")
    for args, says in [
        (("--measured", str(empty)), "no JSON line"),
        (("--set", "warp_s=1"), "no figure 'warp_s'"),
        (("--set", "step_s=fast"), "not a number"),
    ]:
        result = subprocess.run(
            [sys.executable, str(SIM), *args], capture_output=True, text=True, timeout=60
        )
        assert result.returncode != 0 and says in result.stderr, (args, result.stderr)
