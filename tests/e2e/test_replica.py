"""Peer replicas (``checkpoint.replica``): each node copies its newest saved step into the next
node's shared memory, so that a lost node's replacement restores from memory (the lost ranks'
step fetched from the buddy's replica), not from storage; and a buddy lost together with its
node leaves storage, said in the timeline. Either way the training ends as a run without a
fault, bit for bit."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from planaria.testing.jobs import (  # noqa: E402
    EXAMPLE,
    events,
    job,
    restored_from_replicas,
    run,
    weights,
)

OUT = ["--out", "final.pt"]
PACE = ["--pace", "0.15"]
STEPS = 24


def _cmd() -> str:
    # Persisted every 8 steps: a storage restore would redo up to 7 of them. Paced: at full
    # speed (85 ms a step) a busy machine can leave the buddy's replica more steps behind
    # than the survivor keeps of its own, and so no step in common to restore.
    return json.dumps(
        [sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--ckpt-every", "8", *PACE, *OUT]
    )


def _same_weights(one: Path, other: Path) -> None:
    (a_path,) = one.glob("**/final.pt")
    (b_path,) = other.glob("**/final.pt")
    a, b = weights(a_path), weights(b_path)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _faulty_run(tmp_path: Path, mark: str, name: str, **sections: Any) -> list[dict[str, Any]]:
    directory = tmp_path / name
    directory.mkdir()
    config = job(directory, **sections)
    done = run(directory, mark, str(config), "--set", f"job.command={_cmd()}")
    assert done.returncode == 0, done.stdout + done.stderr
    return events(directory)


def _last_resumed(directory: Path) -> dict[int, str]:
    """Each rank's last "resumed from step N (where)" line, from its log (the example
    prints it on rank 0)."""
    found = {}
    for log in directory.glob("**/logs/rank-*.log"):
        lines = [x for x in log.read_text().splitlines() if x.startswith("resumed from step")]
        if lines:
            found[int(log.stem.partition("-")[2])] = lines[-1]
    return found


def _fetched(directory: Path) -> set[tuple[int, int]]:
    """(rank, step) of each replica the job's agents fetched, from their logs."""
    found = set()
    for log in directory.glob("**/*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if "replica fetched" in line:
                rank = re.search(r"\brank=(\d+)", line)
                step = re.search(r"\bstep=(\d+)", line)
                assert rank and step, line
                found.add((int(rank[1]), int(step[1])))
    return found


def _clean(directory: Path, mark: str, **sections: Any) -> Path:
    """A run without a fault, to compare a faulty run's weights with."""
    directory.mkdir()
    done = run(directory, mark, str(job(directory, **sections)), "--set", f"job.command={_cmd()}")
    assert done.returncode == 0, done.stdout + done.stderr
    return directory


def test_a_lost_nodes_ranks_restore_from_their_replica_on_a_standby_node(tmp_path, mark):
    clean = _clean(tmp_path / "clean", mark)
    timeline = _faulty_run(
        tmp_path,
        mark,
        "faulty",
        job={"standby": 1},
        checkpoint={"replica": {}},
        chaos=[{"kind": "kill_node", "node_rank": 1, "at_step": 13}],
    )
    (lost,) = {
        e["node"]
        for e in timeline
        if e["kind"] == "fault_detected" and e["data"].get("fault") == "node_lost"
    }
    assert [e for e in timeline if e["kind"] == "rendezvous_completed"][-1]["data"].get(
        "from_standby"
    )
    # Every rank restored from memory: the survivor's own, the lost node's fetched from the
    # survivor's replica (no step persisted since step 8 was redone from storage).
    step = restored_from_replicas(timeline, lost)
    assert step > 8  # newer than the last persisted step: storage would have redone it
    resumed = _last_resumed(tmp_path / "faulty")
    assert resumed == {0: f"resumed from step {step} (memory)"}, resumed
    # The node that took the lost ranks copied them from the replica before its workers began.
    assert _fetched(tmp_path / "faulty") == {(2, step), (3, step)}
    _same_weights(clean, tmp_path / "faulty")


def test_a_buddy_lost_with_its_node_leaves_storage_and_the_timeline_says_so(tmp_path, mark):
    clean = _clean(tmp_path / "clean", mark, job={"nodes": 3})
    # Three nodes in a ring: 0 -> 1 -> 2 -> 0. Rank 1's node and its buddy (rank 2's) go at
    # once: rank 1's replica went with rank 2's node.
    timeline = _faulty_run(
        tmp_path,
        mark,
        "faulty",
        job={"nodes": 3, "standby": 2},
        checkpoint={"replica": {}},
        chaos=[
            {"kind": "kill_node", "node_rank": 1, "at_step": 13},
            {"kind": "kill_node", "node_rank": 2, "at_step": 13},
        ],
    )
    last = [e for e in timeline if e["kind"] == "rendezvous_completed"][-1]
    assert last["data"]["restore"] == "storage", last["message"]
    assert "holds no step in memory" in last["data"]["restore_why"], last["message"]
    _same_weights(clean, tmp_path / "faulty")
