"""The steps a fault cost are counted from what the workers did, not from what the master heard.

A node's agent is SIGKILLed from outside (no chaos rule: nothing tells the master beforehand);
then, while the survivors' restarted workers run their first steps, the agent that watches them
is stopped for a moment, as a busy node's agent can be. The summary's "steps lost" must still be
exactly what rank 0's log shows: the steps completed before the fault that were done again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from planaria.testing.jobs import EXAMPLE, MARK, events, job, start

pytest.importorskip("torch")

FAST = ["--d-model", "8", "--heads", "1", "--layers", "1", "--seq", "4", "--batch", "1"]


def agent_of(node_id: str, mark: str) -> int:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        wanted = {f"{MARK}={mark}".encode(), f"PLANARIA_NODE_ID={node_id}".encode()}
        if wanted <= set(environ) and b"agent" in cmdline and b"planaria" in cmdline:
            return int(entry.name)
    raise LookupError(f"no agent of {node_id}")


def rank0_log(tmp_path: Path) -> str:
    logs = list(tmp_path.glob("planaria-runs/*/logs/rank-0.log"))
    return logs[0].read_text() if logs else ""


def wait_for(predicate, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.mark.slow
def test_steps_lost_after_an_outside_kill_are_those_the_workers_redid(tmp_path, mark):
    command = [sys.executable, str(EXAMPLE), "--steps", "1600", "--ckpt-every", "100", *FAST]
    config = job(tmp_path, checkpoint={"keep_last": 2})
    master = start(tmp_path, mark, str(config), "--set", f"job.command={json.dumps(command)}")
    try:
        wait_for(lambda: re.search(r"^step 250 ", rank0_log(tmp_path), re.M), "step 250")
        # The node without rank 0 is killed: rank 0's log, which the count is checked against,
        # is written by its node's agent (the lines a killed agent had not read yet are lost).
        (formed,) = [e for e in events(tmp_path) if e["kind"] == "rendezvous_completed"]
        ranks = formed["data"]["ranks"]
        (victim,) = [node for node, rank in ranks.items() if rank != 0]
        (kept,) = [node for node, rank in ranks.items() if rank == 0]
        os.kill(agent_of(victim, mark), signal.SIGKILL)
        wait_for(lambda: "resumed from step" in rank0_log(tmp_path), "the restart")
        survivor = agent_of(kept, mark)
        os.kill(survivor, signal.SIGSTOP)  # its workers run on; it sees their steps late
        time.sleep(1.0)
        os.kill(survivor, signal.SIGCONT)
        output, _ = master.communicate(timeout=240)
    finally:
        if master.poll() is None:
            master.kill()
            master.wait()
    assert master.returncode == 0, output
    before, after = rank0_log(tmp_path).split("resumed from step ", 1)
    last_before = int(re.findall(r"^step (\d+) ", before, re.M)[-1])
    resumed = int(after.split(maxsplit=1)[0])
    first_after = int(re.findall(r"^step (\d+) ", after, re.M)[0])
    assert first_after == resumed + 1
    # The fault table names the step storage gave (the replacement held nothing in memory).
    (run_dir,) = tmp_path.glob("planaria-runs/*")
    faults = json.loads((run_dir / "summary.json").read_text())["faults"]
    (lost,) = [f for f in faults if f["kind"] == "node_lost"]
    assert lost["restored_from"] == f"storage (step {resumed})", lost
    assert f"storage (step {resumed})" in " ".join(output.split())
    recovered = [e for e in events(tmp_path) if e["kind"] == "recovered"]
    assert len(recovered) == 1, output
    # A step printed was completed by every rank (the printed loss is an all-reduce). The
    # converse holds but for one step: the ranks reach the loss's all-reduce only after their
    # optimizer step, and a ring all-reduce can return on some ranks while the lost node's
    # connection fails it on rank 0, so the step after the last one printed may have been done
    # (and reported by another rank) without rank 0 printing it.
    lost_steps = recovered[0]["data"]["steps_lost"]
    if lost_steps not in (last_before - resumed, last_before + 1 - resumed):
        # What the failure report shows whole: the fault as the summary has it, and the steps
        # each node reported, in order.
        print(json.dumps(lost, indent=1))
        for e in events(tmp_path):
            if e.get("step") is not None or e["kind"] in ("fault_detected", "recovered"):
                print(f"{e['time']:.3f} {e['kind']} {e.get('node')} {e.get('step')} {e['message']}")
        print(output)
    assert lost_steps in (last_before - resumed, last_before + 1 - resumed), (
        f"rank 0 printed step {last_before} last, resumed after step {resumed}"
    )
    assert f"{lost_steps}" in output.split("steps lost", 1)[1]
