"""Where a node stands: its handle carries the labels of the Ray node its actor is placed on
(``ray start --labels``), all but Ray's own, or those ``topology_labels`` names; a Ray node
without labels (or a Ray that has none) gives none."""

from __future__ import annotations

import sys
import uuid

import pytest
from pydantic import ValidationError

from planaria.scheduler.api import LaunchSpec
from planaria_ray import RayOptions, RayScheduler
from planaria_ray.cluster import node_topology
from planaria_ray.testing import AGENT, LocalCluster

SLEEP = (sys.executable, "-c", "import time; time.sleep(600)")


def test_a_ray_node_s_topology_is_its_labels_but_ray_s_own() -> None:
    node = {"NodeID": "ab", "Labels": {"ray.io/node-id": "ab", "switch": "s1", "rack": "r7"}}
    assert node_topology(node, None) == {"switch": "s1", "rack": "r7"}
    assert node_topology(node, ["switch", "zone"]) == {"switch": "s1"}
    assert node_topology(node, []) == {}
    assert node_topology({"NodeID": "ab", "Labels": {"ray.io/node-id": "ab"}}, None) == {}
    assert node_topology({"NodeID": "ab"}, None) == {}  # a Ray without node labels


def test_topology_labels_have_names() -> None:
    assert RayOptions().topology_labels is None
    with pytest.raises(ValidationError, match="a topology label has no name"):
        RayOptions(topology_labels=["switch", ""])


@pytest.mark.parametrize("wanted", [None, ["switch", "zone"], ["zone"]])
def test_handles_carry_the_labels_of_the_ray_node_of_their_actor(
    ray_cluster: LocalCluster, wanted: list[str] | None
) -> None:
    """Every worker raylet of the session's cluster has a ``switch`` label and no ``zone``."""
    ray = RayScheduler(
        RayOptions(
            address=ray_cluster.address, resources=AGENT, stop_grace=0.5, topology_labels=wanted
        )
    )
    spec = LaunchSpec(job="topo", command=SLEEP, run_id=f"topo-{uuid.uuid4().hex[:6]}")
    try:
        handles = ray.launch(spec, len(ray_cluster.worker_nodes()))
        assert {h.host for h in handles} == {n.node_id for n in ray_cluster.worker_nodes()}
        for handle in handles:
            labels = ray_cluster.node_by_id(handle.host).labels
            assert labels.keys() == {"switch"}, labels
            assert handle.topology == ({} if wanted == ["zone"] else labels), handle
    finally:
        ray.stop()
