"""``rendezvous.backend: topology`` on the local scheduler, whose ``topology`` option labels its
hosts as a cluster's scheduler would: nodes of one switch get contiguous node ranks although
they join interleaved, a lost node's survivors keep their ranks, and its replacement on the
same switch takes its rank; the job trains to its end. ``planaria status`` and the report show
each node's switch."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")

from planaria.testing.jobs import events, job, run, switches_by_rank
from support.cli import status, status_json

# The local scheduler gives node-N the host local-N; launched together, the switches interleave.
SWITCH = {f"local-{i}": "s1" if i % 2 == 0 else "s2" for i in range(6)}


def test_ranks_follow_switches_and_a_replacement_takes_its_switchs_rank(tmp_path, mark):
    config = job(
        tmp_path,
        job={"nodes": 4, "procs_per_node": 1},
        scheduler={
            "backend": "local",
            "options": {"topology": {h: {"switch": s} for h, s in SWITCH.items()}},
        },
        rendezvous={"backend": "topology"},
        chaos=[{"kind": "kill_node", "node_rank": 1, "at_step": 10}],
    )
    result = run(tmp_path, mark, str(config))
    assert result.returncode == 0, result.stdout + result.stderr

    timeline = events(tmp_path)

    def switch(node: str) -> str:
        return SWITCH[node.replace("node-", "local-", 1)]

    rounds = [e["data"]["ranks"] for e in timeline if e["kind"] == "rendezvous_completed"]
    first, after = rounds[0], rounds[-1]
    # Grouped by switch: s1 takes ranks 0 and 1, s2 ranks 2 and 3.
    assert switches_by_rank(timeline, switch) == ["s1", "s1", "s2", "s2"], first

    (lost,) = [
        e["node"]
        for e in timeline
        if e["kind"] == "fault_detected" and e["data"]["fault"] == "node_lost"
    ]
    assert first[lost] == 1 and switch(lost) == "s1"
    survivors = {n: r for n, r in first.items() if n != lost}
    assert {n: after[n] for n in survivors} == survivors, after
    (replacement,) = set(after) - set(first)
    assert switch(replacement) == "s1"
    assert after[replacement] == 1, after
    (replaced,) = [e for e in timeline if e["kind"] == "node_replaced"]
    assert replaced["data"]["replacement"] == replacement

    # The round says where its members stand; status and the report show it.
    assert rounds and all(
        e["data"]["topology"] == {n: {"switch": switch(n)} for n in e["data"]["ranks"]}
        for e in timeline
        if e["kind"] == "rendezvous_completed"
    )
    (run_dir,) = tmp_path.glob("planaria-runs/*")
    view = status_json(str(run_dir))
    assert {n["node_id"]: n["topology"] for n in view["nodes"]} == {
        n["node_id"]: {"switch": switch(n["node_id"])} for n in view["nodes"]
    }
    text = status(str(run_dir)).stdout
    for n in view["nodes"]:
        row = next(line for line in text.splitlines() if n["node_id"] + " " in line)
        assert f"switch={switch(n['node_id'])}" in row, text
    html = (run_dir / "report.html").read_text()
    assert "<h2>Nodes</h2>" in html
    for node, rank in after.items():
        row = re.search(rf"<tr><td>{node}</td><td>([^<]*)</td><td>([^<]*)</td></tr>", html)
        assert row is not None, (node, html)
        assert row.group(1) == f"switch={switch(node)}" and f"{rank} (round" in row.group(2)
