"""Warm standby nodes (``job.standby``): extra nodes that start with the job, register and warm
their interpreter, and stand by in no round; a lost node's place is taken by one at once, the
scheduler refills the pool in the background, and the training ends as a run without a fault."""

from __future__ import annotations

import json
import sys

import pytest

torch = pytest.importorskip("torch")

from planaria.testing.jobs import EXAMPLE, events, job, run, standby_took_over, weights  # noqa: E402

OUT = ["--out", "final.pt"]


def _cmd() -> str:
    return json.dumps([sys.executable, str(EXAMPLE), "--steps", "24", "--ckpt-every", "4", *OUT])


def test_a_standby_node_takes_a_lost_nodes_place_before_its_replacement_comes(tmp_path, mark):
    clean_dir, faulty_dir = tmp_path / "clean", tmp_path / "faulty"
    clean_dir.mkdir()
    faulty_dir.mkdir()
    clean = run(clean_dir, mark, str(job(clean_dir)), "--set", f"job.command={_cmd()}")
    assert clean.returncode == 0, clean.stdout + clean.stderr

    config = job(
        faulty_dir,
        job={"standby": 1},
        chaos=[{"kind": "kill_node", "node_rank": 1, "at_step": 10}],
    )
    faulty = run(faulty_dir, mark, str(config), "--set", f"job.command={_cmd()}")
    assert faulty.returncode == 0, faulty.stdout + faulty.stderr

    timeline = events(faulty_dir)
    (started,) = [e for e in timeline if e["kind"] == "job_started"]
    assert len(started["data"]["nodes"]) == 3  # 2 in the world, 1 standing by
    rounds = [e for e in timeline if e["kind"] == "rendezvous_completed"]
    first = rounds[0]
    assert len(first["data"]["ranks"]) == 2 and not first["data"].get("from_standby")
    (spare,) = set(started["data"]["nodes"]) - set(first["data"]["ranks"])

    # The loss: the round after it has the node that stood by, in the lost node's rank, and
    # the scheduler's replacement of the lost node refills the pool (it joins no round).
    # (A survivor's worker may fail too, as a secondary fault of the loss: not the lost node.)
    (lost,) = {
        e["node"]
        for e in timeline
        if e["kind"] == "fault_detected" and e["data"].get("fault") == "node_lost"
    }
    replaced = standby_took_over(timeline, lost, spare)
    assert replaced["data"]["replacement"] not in {spare, *first["data"]["ranks"]}
    assert all(
        e["node"] != spare
        for e in timeline
        if e["kind"] == "fault_detected" and not e["data"].get("secondary")
    )

    (clean_out,) = clean_dir.glob("**/final.pt")
    (faulty_out,) = faulty_dir.glob("**/final.pt")
    a, b = weights(clean_out), weights(faulty_out)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
