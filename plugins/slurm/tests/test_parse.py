"""The parsers of Slurm's output, on lines recorded from Slurm 22.05, and on any input."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from planaria_slurm.commands import (
    SlurmCommandError,
    TopologyGroup,
    parse_node_addresses,
    parse_node_states,
    parse_steps,
    parse_topology,
    topology_labels,
)

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


# `scontrol show topology` on the test cluster (cluster.sh: topology/tree, 4 nodes).
TOPOLOGY_TREE = """\
SwitchName=s1 Level=0 LinkSpeed=1 Nodes=node[1-2]
SwitchName=s2 Level=0 LinkSpeed=1 Nodes=node[3-4]
SwitchName=top Level=1 LinkSpeed=1 Nodes=node[1-4] Switches=s[1-2]
"""
# The same without a topology plugin (PLANARIA_SLURM_TOPOLOGY=none): nothing on stdout, exit 0.
NO_TOPOLOGY_STDERR = "scontrol: error: No topology information available\n"
# `scontrol show hostnames node[1-2]` and so on, on the same cluster.
HOSTNAMES = {"node[1-2]": "node1\nnode2\n", "node[3-4]": "node3\nnode4\n"}


def recorded_hostnames(nodelist: str) -> list[str]:
    return HOSTNAMES[nodelist].split()


def test_topology_tree_labels_each_node_with_its_leaf_switch() -> None:
    groups = parse_topology(TOPOLOGY_TREE)
    assert groups == [
        TopologyGroup("switch", "s1", "node[1-2]"),
        TopologyGroup("switch", "s2", "node[3-4]"),
    ]  # the top switch (Level=1) labels no node
    labels = topology_labels(groups, ["node2", "node3", "node4"], recorded_hostnames)
    assert labels == {
        "node2": {"switch": "s1"},
        "node3": {"switch": "s2"},
        "node4": {"switch": "s2"},
    }


def test_no_topology_plugin_gives_no_labels_and_no_error() -> None:
    assert parse_topology("", NO_TOPOLOGY_STDERR) == []


def test_another_scontrol_error_is_one() -> None:
    with pytest.raises(SlurmCommandError, match="Unable to contact slurm controller"):
        parse_topology(
            "", "scontrol: error: Unable to contact slurm controller (connect failure)\n"
        )


def test_topology_block_labels_each_node_with_its_block() -> None:
    """topology/block (Slurm 23.11 on; not in the test cluster's 22.05): lines as its
    documentation gives them."""
    text = (
        "BlockName=b1 BlockIndex=0 Nodes=node[1-2] BlockSize=2\n"
        "BlockName=b2 BlockIndex=1 Nodes=node[3-4] BlockSize=2\n"
    )
    groups = parse_topology(text)
    assert groups == [
        TopologyGroup("block", "b1", "node[1-2]"),
        TopologyGroup("block", "b2", "node[3-4]"),
    ]
    labels = topology_labels(groups, ["node1", "node4"], recorded_hostnames)
    assert labels == {"node1": {"block": "b1"}, "node4": {"block": "b2"}}


@given(st.text())
def test_parsers_take_any_text(text: str) -> None:
    for status in parse_node_states(text).values():
        assert status.name and "|" not in status.name
    for name, address in parse_node_addresses(text).items():
        assert name and address and "|" not in name and "\n" not in address
    for step in parse_steps(text).values():
        assert "." in step and "|" not in step
    try:
        groups = parse_topology(text, text)
    except SlurmCommandError:
        return
    for group in groups:
        assert group.label in ("switch", "block") and group.name and group.nodes
