"""The parsers of Slurm's output, on lines recorded from Slurm 22.05, and on any input."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from planaria_slurm.commands import parse_node_addresses, parse_node_states, parse_steps

SINFO = """\
node1|idle|none
node2|down*|Not responding
node3|drained|planaria: ECC errors
node4|mixed|none
node5|allocated*|none
node6|idle~|none
node7|draining|maint
node1|idle|none
"""


def test_node_states() -> None:
    nodes = parse_node_states(SINFO)
    assert sorted(nodes) == [f"node{i}" for i in range(1, 8)]
    assert nodes["node1"].usable and nodes["node4"].usable and nodes["node6"].usable
    assert not nodes["node2"].usable and not nodes["node2"].responding
    assert nodes["node2"].describe() == "Slurm node node2 is down, not responding (Not responding)"
    assert not nodes["node3"].usable
    assert nodes["node3"].describe() == "Slurm node node3 is drained (planaria: ECC errors)"
    assert not nodes["node5"].usable  # allocated, but its slurmd does not answer
    assert not nodes["node7"].usable
    assert nodes["node1"].reason == ""


def test_steps() -> None:
    text = "7.0|planaria.run.node-0\n7.batch|batch\n7.extern|extern\n7.12|planaria.run.node-3\n"
    assert parse_steps(text) == {"planaria.run.node-0": "7.0", "planaria.run.node-3": "7.12"}


def test_node_addresses() -> None:
    """``sinfo -h -N -o '%N|%o'``: the node's name and its NodeAddr."""
    text = "node1|127.0.0.1\nnode2|10.0.0.12\nnode1|10.9.9.9\ngpu-3|gpu-3.ib\n|x\nnode9|\n"
    assert parse_node_addresses(text) == {
        "node1": "127.0.0.1",
        "node2": "10.0.0.12",
        "gpu-3": "gpu-3.ib",
    }


@given(st.text())
def test_parsers_take_any_text(text: str) -> None:
    for status in parse_node_states(text).values():
        assert status.name and "|" not in status.name
    for name, address in parse_node_addresses(text).items():
        assert name and address and "|" not in name and "\n" not in address
    for step in parse_steps(text).values():
        assert "." in step and "|" not in step
