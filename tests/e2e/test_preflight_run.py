"""The pre-flight node check end to end: ``planaria run`` and ``planaria check --preflight``
with real agents on the local scheduler, a node made slow and a node made to fail."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from planaria.testing.jobs import EXAMPLE, MARK, events, job, run

pytest.importorskip("torch")

# Factor 6 against a threshold of 3: load on a shared machine does not make a false suspect,
# and the matmul is timed in CPU time, a median of five.
PREFLIGHT = {
    "checks": [],
    "preflight": True,
    "preflight_timeout": "20s",
    "preflight_factor": 3,
}
CHAOS = [
    {"kind": "slow_node", "node": "node-1", "factor": 6},
    {"kind": "fail_node", "node": "node-2"},
]


def test_a_failing_and_a_slow_node_are_found_replaced_and_kept_out_of_training(tmp_path, mark):
    command = [sys.executable, str(EXAMPLE), "--steps", "6", "--ckpt-every", "3"]
    config = job(
        tmp_path,
        job={"nodes": 4, "procs_per_node": 1, "preload": [], "command": command},
        scheduler={"backend": "local", "options": {"hosts": 0}},
        diagnosis={**PREFLIGHT, "preflight_replace_stragglers": True},
        chaos=CHAOS,
    )
    result = run(tmp_path, mark, str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    timeline = events(tmp_path)
    kinds = [e["kind"] for e in timeline]

    rounds = [e for e in timeline if e["kind"] == "preflight_round"]
    stages = [e["data"]["stage"] for e in rounds]
    assert stages[:2] == ["round 1", "round 2"] and set(stages[2:]) <= {"newcomer"}
    first = rounds[0]["data"]
    assert {"node-1", "node-2"} <= set(first["suspects"])
    # Slow; or, when it was paired with the failing node, stopped with its group.
    assert first["suspects"]["node-1"].startswith(("slow: matmul", "its group failed (node-2 "))
    verdicts = {v["node"]: v["verdict"] for v in rounds[1]["data"]["verdicts"]}
    assert verdicts["node-1"] == "straggler" and verdicts["node-2"] == "faulty"
    assert all(v == "cleared" for n, v in verdicts.items() if n not in ("node-1", "node-2"))

    (fault,) = [e for e in timeline if e["kind"] == "fault_detected"]
    assert fault["node"] == "node-2" and fault["data"]["fault"] == "preflight"
    assert "InjectedFault" in fault["data"]["reason"]
    (slow,) = [e for e in timeline if e["kind"] == "straggler_detected"]
    assert slow["node"] == "node-1" and slow["data"]["preflight"] is True
    assert slow["data"]["ratio"] > 3
    assert slow["data"]["action"] == "replace the node, exclude host local-1"
    excluded = {e["data"]["host"] for e in timeline if e["kind"] == "node_excluded"}
    assert excluded == {"local-1", "local-2"}
    replaced = {
        e["node"]: e["data"]["replacement"] for e in timeline if e["kind"] == "node_replaced"
    }
    assert set(replaced) == {"node-1", "node-2"}

    # The replacements were checked next to a known-good node before anyone trained.
    newcomers = [e for e in rounds if e["data"]["stage"] == "newcomer"]
    checked = {v["node"]: v for e in newcomers for v in e["data"]["verdicts"]}
    assert set(checked) == set(replaced.values())
    assert all(v["verdict"] == "cleared" and "next to good node" in v["detail"]
               for v in checked.values())  # fmt: skip
    done = kinds.index("preflight_completed")
    assert done < kinds.index("rendezvous_completed")
    verdicts = {
        v["node"]: (v["verdict"], v["host"], v["action"])
        for v in timeline[done]["data"]["verdicts"]
    }
    assert verdicts["node-2"] == ("faulty", "local-2", "replace the node, exclude host local-2")
    assert verdicts["node-1"] == ("straggler", "local-1", "replace the node, exclude host local-1")

    # Training ran without them, and completed.
    (world,) = [e for e in timeline if e["kind"] == "rendezvous_completed"]
    assert set(world["data"]["ranks"]) == {"node-0", "node-3", *replaced.values()}
    assert kinds[-1] == "job_finished"
    summary = " ".join(result.stdout.split())
    assert "pre-flight: 6 node(s), 2 round(s)" in summary
    assert "node-2 │ local-2 │ faulty" in summary and "node-1 │ local-1 │ straggler" in summary


def test_check_preflight_runs_the_check_alone_and_tells_a_hung_node(tmp_path, mark):
    config = job(
        tmp_path,
        job={"nodes": 3, "procs_per_node": 1},
        scheduler={"backend": "local", "options": {"hosts": 0}},
        # 15 s: the healthy nodes' own round must fit in it on a busy machine (8 s did not).
        diagnosis={**PREFLIGHT, "preflight": False, "preflight_timeout": "15s"},
        chaos=[{"kind": "fail_node", "node": "node-0", "how": "hang"}],
    )
    env = {**os.environ, MARK: mark, "COLUMNS": "200"}
    planaria = str(Path(sys.executable).parent / "planaria")
    result = subprocess.run(
        [planaria, "check", "--preflight", "--json", "-c", str(config)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout[result.stdout.index("{") :])
    assert not report["healthy"] and (report["nodes"], report["rounds"]) == (3, 2)
    verdicts = {v["node"]: v for v in report["verdicts"]}
    # All three were one group in round 1: the hung node held the others until the timeout.
    assert verdicts["node-0"]["verdict"] == "faulty"
    assert "timeout: the benchmark did not finish within 15s" in verdicts["node-0"]["detail"]
    assert {verdicts[n]["verdict"] for n in ("node-1", "node-2")} == {"cleared"}
    timeline = events(tmp_path)
    assert not any(e["kind"] in ("node_replaced", "rendezvous_completed") for e in timeline)
    assert not list(tmp_path.glob("planaria-runs/*/logs/rank-*.log"))  # no worker started


def test_an_all_pass_preflight_says_so_in_one_line(tmp_path, mark):
    config = job(
        tmp_path,
        job={"nodes": 2, "procs_per_node": 1},
        scheduler={"backend": "local", "options": {"hosts": 0}},
        # A factor no busy machine reaches: this test is about the all-pass line, not about
        # finding a slow node (a node 3x slower than the other under load is no rarity).
        diagnosis={**PREFLIGHT, "preflight": False, "preflight_factor": 1000},
    )
    env = {**os.environ, MARK: mark, "COLUMNS": "200"}
    planaria = str(Path(sys.executable).parent / "planaria")
    result = subprocess.run(
        [planaria, "check", "--preflight", "-c", str(config)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("pre-flight:")]
    assert re.fullmatch(
        r"pre-flight: all 2 nodes passed in 1 round \(matmul: slowest [\d.]+ ms on node-[01], "
        r"median [\d.]+ ms\)",
        line,
    ), line
    assert "┃" not in result.stdout  # no table
