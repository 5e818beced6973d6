"""``planaria run`` end to end: real master, agents, warm workers and DDP training over gloo.

Every run is marked through its environment; after each test no process carrying the mark may
be alive (agents, warm interpreters, workers and their children all inherit it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from planaria.testing.jobs import EXAMPLE, MARK, events, job, run, start, weights  # noqa: E402
from planaria.testing.processes import processes_with  # noqa: E402


def test_faults_are_recovered_and_the_weights_are_bitwise_those_of_a_clean_run(tmp_path, mark):
    clean_dir, faulty_dir = tmp_path / "clean", tmp_path / "faulty"
    clean_dir.mkdir()
    faulty_dir.mkdir()
    out = ["--out", "final.pt"]
    clean = run(clean_dir, mark, str(job(clean_dir)), "--set", f"job.command={_cmd(out)}")
    assert clean.returncode == 0, clean.stdout + clean.stderr

    chaos = [
        {"kind": "kill_worker", "rank": 1, "at_step": 6},
        {"kind": "raise_in_worker", "rank": 2, "at_step": 11, "attempt": 1},
        {"kind": "kill_node", "node_rank": 1, "at_step": 17, "attempt": 2},
    ]
    faulty = run(
        faulty_dir, mark, str(job(faulty_dir, chaos=chaos)), "--set", f"job.command={_cmd(out)}"
    )
    assert faulty.returncode == 0, faulty.stdout + faulty.stderr
    assert "succeeded" in faulty.stdout

    timeline = events(faulty_dir)
    detected = [e for e in timeline if e["kind"] == "fault_detected"]
    faults = [
        e for e in detected if e["data"]["fault"] != "chaos" and not e["data"].get("secondary")
    ]
    kinds = [e["data"]["fault"] for e in faults]
    assert kinds[:2] == ["worker_failed", "worker_failed"] and "node_lost" in kinds
    assert faults[0]["data"]["signal"] == 9 and faults[0]["rank"] == 1
    # A peer ("a remote worker crashed") may fail before the exception's own worker exits,
    # and be the round's first failure; the exception is always in its rank's log.
    (logs,) = faulty_dir.glob("planaria-runs/*/logs")
    assert "InjectedFault" in (logs / "rank-2.log").read_text()
    assert any(e["kind"] == "node_replaced" for e in timeline)
    recovered = [e for e in timeline if e["kind"] == "recovered"]
    assert len(recovered) >= 3
    assert not [e for e in timeline if e["kind"] == "node_replacement_failed"]

    # The worker kill: every rank held the killed worker's last step in memory, the restart
    # restored it from there (no step lost) and, persist at fault, committed it to storage.
    rounds = [e for e in timeline if e["kind"] == "rendezvous_completed"]
    restore = rounds[1]["data"]["restore"]
    assert restore.startswith("memory:"), rounds[1]["message"]
    step = int(restore.split(":")[1])
    # The killed worker had saved step 6; a peer stopped before its own save of step 6 holds
    # step 5 at most. The restore is the newest step all hold, and only later steps are lost.
    assert step in (5, 6)
    assert recovered[0]["data"]["steps_lost"] == 6 - step
    committed = {e["step"] for e in timeline if e["kind"] == "checkpoint_committed"}
    assert step in committed and rounds[1]["data"]["persist_step"] == step
    # The node kill: the replacement holds nothing in memory, so that round used storage.
    assert rounds[-1]["data"]["restore"] == "storage"
    # ... and the lost node's rounds are fenced out of the storage: the round without it
    # and every later one may commit, no earlier one.
    (fence,) = faulty_dir.glob("planaria-runs/*/**/fence")
    generation = json.loads(fence.read_text())["generation"]
    assert generation == rounds[-1]["data"]["round"]
    manifests = [json.loads(m.read_text()) for m in fence.parent.glob("step-*/manifest.json")]
    later = [m for m in manifests if m["created"] > fence.stat().st_mtime]
    assert later and all(m["generation"] >= generation for m in later)

    (clean_out,) = clean_dir.glob("**/final.pt")
    (faulty_out,) = faulty_dir.glob("**/final.pt")
    a, b = weights(clean_out), weights(faulty_out)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _cmd(extra: list[str]) -> str:
    return json.dumps([sys.executable, str(EXAMPLE), "--steps", "24", "--ckpt-every", "4", *extra])


def test_more_nodes_than_can_come_is_a_clear_error_after_the_join_timeout(tmp_path, mark):
    config = job(
        tmp_path,
        job={"nodes": 3, "procs_per_node": 1},
        scheduler={"backend": "local", "options": {"slots": 2}},
        rendezvous={"join_timeout": "4s"},
    )
    result = run(tmp_path, mark, str(config))
    assert result.returncode == 1
    # At most 2 of the 3 can come (2 slots); on a busy machine the second may not have
    # joined within the 4 s either.
    assert re.search(
        r"rendezvous timed out: [12] node\(s\) joined round 1 within 4s, at least 3 needed",
        " ".join(result.stdout.split()),
    ), result.stdout[-3000:]


def test_a_spent_restart_budget_stops_the_job_with_the_reason(tmp_path, mark):
    chaos = [
        {"kind": "kill_worker", "rank": 0, "at_step": 2},
        # After the restart the workers resume after the step they restored (from memory):
        # the second kill must come later than the first.
        {"kind": "kill_worker", "rank": 0, "at_step": 6, "attempt": 1},
    ]
    config = job(tmp_path, job={"nodes": 1, "max_restarts": 1}, chaos=chaos)
    result = run(tmp_path, mark, str(config))
    assert result.returncode == 1
    text = " ".join(result.stdout.split())
    assert "restart budget spent (1 of 1 restarts used); last fault: rank 0" in text
    stopped = [e for e in events(tmp_path) if e["kind"] == "job_stopped"]
    assert [e["data"]["cause"] for e in stopped] == ["restart_budget_spent"]


def _node_process(mark: str, node_id: str) -> int | None:
    """The agent of ``node_id`` of the run marked ``mark``, once it exists."""
    found = processes_with({f"{MARK}={mark}".encode(), f"PLANARIA_NODE_ID={node_id}".encode()})
    return found[0] if found else None


def test_an_elastic_job_goes_on_with_fewer_nodes_then_grows_back(tmp_path, mark):
    """node-1 is lost; its replacement (node-2) is held stopped from the moment its process
    exists until the job went on with node-0 alone, then let go: the job takes it back in.

    Holding it is what a replacement waiting for a cluster's free machine looks like. Without
    it, which comes first is a race: on a loaded machine the survivor may re-join later than
    the replacement starts, and the round after the loss then simply has both."""
    config = job(
        tmp_path,
        job={"nodes": "1:2", "procs_per_node": 1},
        rendezvous={"join_grace": "1s"},
        chaos=[{"kind": "kill_node", "node_rank": 1, "at_step": 4}],
    )
    command = json.dumps([sys.executable, str(EXAMPLE), "--steps", "60", "--ckpt-every", "5"])
    proc = start(tmp_path, mark, str(config), "--set", f"job.command={command}")
    held = None
    try:
        deadline = time.monotonic() + 180
        while (held := _node_process(mark, "node-2")) is None:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "node-1 was not replaced"
            time.sleep(0.01)
        os.kill(held, signal.SIGSTOP)
        while not _sizes_after_the_loss(tmp_path):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "no round after the loss"
            time.sleep(0.05)
        os.kill(held, signal.SIGCONT)
        output, _ = proc.communicate(timeout=240)
    finally:
        if held is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(held, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output
    timeline = events(tmp_path)
    sizes = _sizes_after_the_loss(tmp_path)
    assert sizes[0] == 1 and sizes[-1] == 2, sizes  # on alone, then both
    restarts = [e["data"] for e in timeline if e["kind"] == "workers_restarted"]
    assert any(r["cause"] == "scale_up" and r["standby"] == ["node-2"] for r in restarts), restarts


def _sizes_after_the_loss(tmp_path: Path) -> list[int]:
    """The number of nodes of each round formed since a node was lost, so far. (On a loaded
    machine the first round may already form with one node, the other joining late.)"""
    found = list(tmp_path.glob("planaria-runs/*/events.jsonl"))
    text = found[0].read_text() if found else ""
    lines = text.splitlines()[: text.count("\n")]  # not a line still being written
    sizes: list[int] | None = None
    for event in map(json.loads, lines):
        if event["kind"] == "fault_detected" and event["data"]["fault"] == "node_lost":
            sizes = []
        elif event["kind"] == "rendezvous_completed" and sizes is not None:
            sizes.append(len(event["data"]["ranks"]))
    return sizes or []


def test_the_command_after_dashes_and_a_failing_command_with_no_budget(tmp_path, mark):
    config = job(tmp_path, job={"nodes": 1, "procs_per_node": 1, "max_restarts": 0})
    failing = "import sys; print('about to fail', file=sys.stderr); sys.exit(3)"
    result = run(tmp_path, mark, str(config), "--", sys.executable, "-c", failing)
    assert result.returncode == 1
    (fault,) = [e for e in events(tmp_path) if e["kind"] == "fault_detected"]
    assert fault["data"]["exitcode"] == 3
    assert "about to fail" in fault["data"]["log_tail"]
    # Its node's agent ended well (exit 0), which says nothing of the job: no "succeeded".
    assert "node's agent exited" in result.stderr and "how='exit code 0'" in result.stderr
    assert "state=succeeded" not in result.stdout + result.stderr
    ok = run(tmp_path, mark, str(config), "--", sys.executable, "-c", "print('fine')")
    assert ok.returncode == 0, ok.stdout + ok.stderr


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_the_job_and_exits_128_plus_its_number(tmp_path, mark, sig, code):
    """A requeue wrapper tells a stop it asked for (SIGTERM before a preemption, Ctrl-C) from a
    crash (exit 1) by the code a shell gives a process that signal killed."""
    forever = [sys.executable, "-c", "import time; time.sleep(600)"]
    config = job(tmp_path, job={"nodes": 1, "procs_per_node": 1, "command": forever})
    proc = start(tmp_path, mark, str(config))
    try:
        deadline = time.monotonic() + 120
        timelines = "planaria-runs/*/events.jsonl"
        while not any('"job_started"' in p.read_text() for p in tmp_path.glob(timelines)):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.1)
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, output
    assert f"failed: interrupted by {sig.name}" in " ".join(output.split()), output
    stopped = [e["data"]["cause"] for e in events(tmp_path) if e["kind"] == "job_stopped"]
    assert stopped == ["interrupted"]


def test_a_lost_node_is_a_node_fault_with_how_it_was_lost(tmp_path, mark):
    short = [sys.executable, "-c", "import time; time.sleep(3)"]
    config = job(
        tmp_path,
        job={"nodes": 2, "procs_per_node": 1, "command": short},
        rendezvous={"join_grace": "300ms"},
        chaos=[{"kind": "kill_node", "node_rank": 1, "after": "1s"}],
    )
    result = run(tmp_path, mark, str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    (lost,) = [
        e
        for e in events(tmp_path)
        if e["kind"] == "fault_detected" and e["data"]["fault"] == "node_lost"
    ]
    assert lost["data"]["fault_class"] == "node"
    assert lost["data"]["reason"].startswith("agent process ended: "), lost["data"]
    text = " ".join(result.stdout.split())
    assert "node_lost │ node: agent process ended: " in text, text
