"""``rendezvous.store: master``: the workers' store on the master's host. Rank 0's node is
lost mid-training and the store it would have hosted is not lost with it: the job recovers and
ends bit for bit as a run without a fault (whose store was on rank 0, as by default). A master
killed mid-round takes its store host with it; the resumed master gives the next round one."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from planaria.testing.jobs import (  # noqa: E402
    EXAMPLE,
    events,
    job,
    marked_processes,
    run,
    start,
    wait_for,
    weights,
)

OUT = ["--out", "final.pt"]


def _cmd() -> str:
    return json.dumps([sys.executable, str(EXAMPLE), "--steps", "24", "--ckpt-every", "4", *OUT])


def test_losing_rank_0s_node_with_the_store_on_the_master(tmp_path, mark):
    clean_dir, faulty_dir = tmp_path / "clean", tmp_path / "faulty"
    clean_dir.mkdir()
    faulty_dir.mkdir()
    clean = run(clean_dir, mark, str(job(clean_dir)), "--set", f"job.command={_cmd()}")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert all("store" not in e["data"] for e in events(clean_dir) if "data" in e)

    config = job(
        faulty_dir,
        rendezvous={"store": "master"},
        chaos=[{"kind": "kill_node", "node_rank": 0, "at_step": 10}],
    )
    faulty = run(faulty_dir, mark, str(config), "--set", f"job.command={_cmd()}")
    assert faulty.returncode == 0, faulty.stdout + faulty.stderr

    timeline = events(faulty_dir)
    rounds = [e for e in timeline if e["kind"] == "rendezvous_completed"]
    assert len(rounds) >= 2, [e["kind"] for e in timeline]
    # Every round had a store of its own, on the master's host (the master binds 127.0.0.1).
    stores = [r["data"]["store"] for r in rounds]
    assert all(s.startswith("127.0.0.1:") for s in stores), stores
    assert len(set(stores)) == len(stores), stores
    (rank0,) = [n for n, r in rounds[0]["data"]["ranks"].items() if r == 0]
    (lost,) = {
        e["node"]
        for e in timeline
        if e["kind"] == "fault_detected" and e["data"].get("fault") == "node_lost"
    }
    assert lost == rank0
    assert rank0 not in rounds[-1]["data"]["ranks"]
    (logs,) = faulty_dir.glob("planaria-runs/*/logs")
    assert (logs / "store.log").exists()

    (clean_out,) = clean_dir.glob("**/final.pt")
    (faulty_out,) = faulty_dir.glob("**/final.pt")
    a, b = weights(clean_out), weights(faulty_out)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _store_hosts(mark: str) -> list[int]:
    return [p for p in marked_processes(mark) if "planaria.master.store" in _cmdline(p)]


def _rank0_step(tmp_path: Path) -> int:
    logs = list(tmp_path.glob("planaria-runs/*/logs/rank-0.log"))
    lines = logs[0].read_text().splitlines() if logs else []
    return max((int(line.split()[1]) for line in lines if line.startswith("step ")), default=-1)


def test_a_resumed_master_gives_the_next_round_a_store(tmp_path, mark):
    """The master dies mid-round: its store host dies with it, the round trains on, and the
    round after the resume (a worker killed) gets a store of the new master's."""
    command = json.dumps([sys.executable, str(EXAMPLE), "--steps", "48", "--ckpt-every", "4", *OUT])
    sections = {
        "job": {"procs_per_node": 1},
        "master": {"heartbeat_interval": "0.5s", "heartbeat_timeout": "10s", "grace": "60s"},
    }
    clean_dir, faulty_dir = tmp_path / "clean", tmp_path / "faulty"
    clean_dir.mkdir()
    faulty_dir.mkdir()
    clean = run(clean_dir, mark, str(job(clean_dir, **sections)), "--set", f"job.command={command}")
    assert clean.returncode == 0, clean.stdout + clean.stderr

    config = job(
        faulty_dir,
        **sections,
        rendezvous={"store": "master"},
        chaos=[{"kind": "kill_worker", "rank": 1, "at_step": 36}],
    )
    proc = start(faulty_dir, mark, str(config), "--set", f"job.command={command}")
    try:
        wait_for("step 10", lambda: _rank0_step(faulty_dir) >= 10, 180)
        (host,) = _store_hosts(mark)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        wait_for("the store host gone with the master", lambda: not _store_hosts(mark), 10)
        killed_at = _rank0_step(faulty_dir)
        wait_for("training on without a master", lambda: _rank0_step(faulty_dir) > killed_at + 1)
        (run_dir,) = faulty_dir.glob("planaria-runs/*")
        resumed = run(faulty_dir, mark, "--resume", str(run_dir))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert host not in _store_hosts(mark)

    timeline = events(faulty_dir)
    kinds = [e["kind"] for e in timeline]
    assert "master_resumed" in kinds and "fault_detected" in kinds
    rounds = [e for e in timeline if e["kind"] == "rendezvous_completed"]
    assert len(rounds) >= 2 and all(r["data"]["store"] for r in rounds), rounds
    assert rounds[-1]["data"]["store"] != rounds[0]["data"]["store"]
    resumed_at = kinds.index("master_resumed")
    assert timeline.index(rounds[-1]) > resumed_at  # the new master's store served it

    (clean_out,) = clean_dir.glob("**/final.pt")
    (faulty_out,) = faulty_dir.glob("**/final.pt")
    a, b = weights(clean_out), weights(faulty_out)
    assert all(torch.equal(a[k], b[k]) for k in a)
