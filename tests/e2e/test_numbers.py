"""The figures a run ends with agree with each other and say what they are.

One run like the demo (two nodes, the second killed by a chaos rule) is read four ways: the
summary ``planaria run`` prints, the report, ``planaria status`` of the run over, and the
timeline; a second run is stopped with SIGTERM while it trains.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from planaria.shm import TAG_ENV, name_prefix
from planaria.testing.jobs import EXAMPLE, events, job, run, start, wait_gone
from planaria.testing.leaks import assert_no_shm_left
from support.cli import status, status_json

pytest.importorskip("torch")

FAST = ["--d-model", "8", "--heads", "1", "--layers", "1", "--seq", "4", "--batch", "1"]
KILL_AT = 40


@dataclass
class Run:
    run_dir: Path
    output: str
    summary: dict


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The demo's course, smaller: node rank 1's agent SIGKILLed at step ``KILL_AT``."""
    tmp_path = tmp_path_factory.mktemp("demo")
    mark = uuid.uuid4().hex
    tag = f"n{uuid.uuid4().hex[:8]}"  # its files in /dev/shm are its own, as a test's are
    before = os.environ.get(TAG_ENV)
    os.environ[TAG_ENV] = tag
    try:
        prefix = name_prefix()
        command = [sys.executable, str(EXAMPLE), "--steps", "80", "--ckpt-every", "10", *FAST]
        config = job(
            tmp_path,
            job={"procs_per_node": 1, "command": command},
            checkpoint={"keep_last": 2, "persist_on_fault": True},
            chaos=[{"kind": "kill_node", "node_rank": 1, "at_step": KILL_AT}],
        )
        result = run(tmp_path, mark, str(config))
        assert not wait_gone(mark, grace=10), "processes of the run outlived it"
        assert_no_shm_left(prefix)
    finally:
        if before is None:
            os.environ.pop(TAG_ENV, None)
        else:
            os.environ[TAG_ENV] = before
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = tmp_path.glob("planaria-runs/*")
    yield Run(run_dir, result.stdout, json.loads((run_dir / "summary.json").read_text()))


def row(output: str, what: str) -> str:
    """The value of one line of the printed summary."""
    found = re.search(rf"│ {re.escape(what)}\s*│ (.*?)\s*│", output)
    assert found, f"no {what!r} line in:\n{output}"
    return found.group(1)


def test_the_goodput_is_shown_with_its_definition_and_figures(demo: Run) -> None:
    s = demo.summary
    goodput = row(demo.output, "goodput")
    lost = s["startup_s"] + s["downtime_s"]
    ratio = (s["wall_s"] - lost) / s["wall_s"]
    assert goodput == (
        f"{ratio:.1%}: time training over wall time: start-up and recovery count against it "
        f"(({s['wall_s']:.2f}s wall time - {s['startup_s']:.2f}s start-up - "
        f"{s['downtime_s']:.2f}s recovery) / {s['wall_s']:.2f}s)"
    )
    html = (demo.run_dir / "report.html").read_text()
    assert f"<th>goodput</th><td>{goodput}</td>" in html


def test_status_counts_the_steps_done_as_the_summary_does(demo: Run) -> None:
    steps = demo.summary["steps"]
    assert row(demo.output, "steps done") == str(steps)
    # The example numbers its steps from 0: 80 steps end at step 79.
    assert steps == 80
    view = status_json(str(demo.run_dir))
    assert (view["steps_done"], view["step"]) == (steps, steps - 1)
    text = status(str(demo.run_dir))
    assert text.returncode == 0, text.stderr
    assert f"steps done {steps} (last step {steps - 1})" in text.stdout, text.stdout


def test_a_lost_node_shows_the_step_it_was_lost_at(demo: Run) -> None:
    (lost,) = [f for f in demo.summary["faults"] if f["kind"] == "node_lost"]
    timeline = events(demo.run_dir.parent.parent)
    (chaos,) = [
        e for e in timeline if e["kind"] == "fault_detected" and e["data"]["fault"] == "chaos"
    ]
    assert chaos["node"] == lost["node"] and chaos["step"] >= KILL_AT, chaos
    assert f"at step {chaos['step']}" in chaos["message"]
    # Its last sample in the timeline, and so its line in `planaria status` once the job is
    # over, is where it got, not a sample from the round's start.
    samples = [e["step"] for e in timeline if e["kind"] == "progress" and e["node"] == lost["node"]]
    assert samples[-1] >= chaos["step"], samples
    nodes = {n["node_id"]: n for n in status_json(str(demo.run_dir))["nodes"]}
    assert nodes[lost["node"]]["state"] == "lost"
    assert nodes[lost["node"]]["step"] >= chaos["step"], nodes
    assert lost["last_step"] >= chaos["step"], lost


def test_steps_done_after_sigterm_count_every_step_reported(tmp_path, mark) -> None:
    """SIGTERM comes just after a checkpoint was committed, before a heartbeat (every 3 s)
    could tell the master of that step: the checkpoint's event told of it first."""
    command = [sys.executable, str(EXAMPLE), "--steps", "100000", "--ckpt-every", "10", *FAST]
    config = job(
        tmp_path,
        job={"procs_per_node": 1, "command": command},
        master={"heartbeat_interval": "3s", "heartbeat_timeout": "30s"},
    )
    proc = start(tmp_path, mark, str(config))
    try:
        _wait_committed(tmp_path, proc, 19)
        (run_dir,) = tmp_path.glob("planaria-runs/*")
        live = status_json(str(run_dir))
        assert live["running"] and live["steps_done"] == live["step"] + 1, live
        _wait_committed(tmp_path, proc, _committed(tmp_path) + 20, poll=0.005)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, output
    summary = json.loads((run_dir / "summary.json").read_text())
    stepped = [e["step"] for e in events(tmp_path) if e.get("step") is not None]
    # Every step reported was done, checkpointed ones included: steps done count (from step
    # 0) to the newest, at least as far as the newest the timeline tells of.
    assert summary["steps"] >= max(stepped) + 1, (summary["steps"], max(stepped))
    assert summary["steps"] >= summary["last_checkpoint"] + 1 >= 40, summary
    assert row(output, "steps done") == str(summary["steps"])
    assert f"last: step {summary['last_checkpoint']})" in row(output, "checkpoints committed")
    over = status_json(str(run_dir))
    assert (over["steps_done"], over["step"]) == (summary["steps"], summary["steps"] - 1)


def _wait_committed(
    tmp_path: Path, proc: subprocess.Popen[str], step: int, poll: float = 0.1
) -> None:
    deadline = time.monotonic() + 120
    while (newest := _committed(tmp_path)) < step:
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, f"no checkpoint of step {step} or later ({newest})"
        time.sleep(poll)


def _committed(tmp_path: Path) -> int:
    """The newest step committed so far (-1: none)."""
    found = list(tmp_path.glob("planaria-runs/*/events.jsonl"))
    text = found[0].read_text() if found else ""
    lines = text.splitlines()[: text.count("\n")]  # not a line still being written
    steps = [e["step"] for e in map(json.loads, lines) if e["kind"] == "checkpoint_committed"]
    return max(steps, default=-1)
