"""Where a node stands: its handle carries the labels ``topology_labels`` names, read off the
Kubernetes node its pod is bound to (at launch and at a replacement); a node without them has
none; the option is checked when the config loads; and a cluster whose nodes cannot be read
is an error of the launch, naming the nodes and Kubernetes' reason."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from planaria.errors import SchedulerError
from planaria.scheduler.api import LaunchSpec
from planaria_kubernetes import KubernetesOptions
from planaria_kubernetes.options import TOPOLOGY_LABELS
from planaria_kubernetes.scheduler import node_topology
from planaria_kubernetes.testing import EmulatedCluster

SLEEP = (sys.executable, "-c", "import time; time.sleep(600)")
SWITCH = TOPOLOGY_LABELS["switch"]
ZONE = TOPOLOGY_LABELS["zone"]
LABELS = {
    "kube-a": {SWITCH: "s1", ZONE: "z1", "example.com/rack": "r1"},
    "kube-b": {SWITCH: "s2", ZONE: "z1"},
    "kube-c": {},
}
"""kube-c carries no topology label (only the ones every node has)."""


def test_a_node_s_topology_is_the_labels_the_option_names() -> None:
    node = {"metadata": {"labels": {SWITCH: "s1", "kubernetes.io/hostname": "kube-a"}}}
    wanted = {"switch": SWITCH, "zone": ZONE}
    assert node_topology(node, wanted) == {"switch": "s1"}
    assert node_topology({"metadata": {"name": "bare"}}, wanted) == {}
    assert node_topology({}, wanted) == {}
    assert node_topology(node, {}) == {}


def test_topology_labels_must_be_label_keys() -> None:
    assert KubernetesOptions(image="x").topology_labels == {
        "region": "topology.kubernetes.io/region",
        "zone": "topology.kubernetes.io/zone",
        "switch": "network.topology.nvidia.com/leaf",
    }
    mine = KubernetesOptions(image="x", topology_labels={"switch": "example.com/rack"})
    assert mine.topology_labels == {"switch": "example.com/rack"}
    with pytest.raises(ValidationError, match=r"switch: 'rack id' is not a Kubernetes label key"):
        KubernetesOptions(image="x", topology_labels={"switch": "rack id"})
    with pytest.raises(ValidationError, match="the topology label it fills has no name"):
        KubernetesOptions(image="x", topology_labels={"": "example.com/rack"})


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmulatedCluster]:
    with EmulatedCluster(nodes=tuple(LABELS), node_labels=LABELS) as emulated:
        yield emulated


@pytest.fixture
def spec() -> LaunchSpec:
    return LaunchSpec(job="topo", command=SLEEP, run_id=f"topo-{uuid.uuid4().hex[:6]}")


def expected(host: str, wanted: dict[str, str]) -> dict[str, str]:
    return {name: LABELS[host][key] for name, key in wanted.items() if key in LABELS[host]}


def test_handles_carry_the_labels_of_the_kubernetes_node_of_their_pod(
    cluster: EmulatedCluster, spec: LaunchSpec
) -> None:
    """Two pods go on two of the three nodes, the third is where the replacement goes: every
    node's labels are seen once, kube-c's none."""
    k8s = cluster.scheduler()
    try:
        handles = k8s.launch(spec, 2)
        assert len({h.host for h in handles}) == 2, handles
        for handle in handles:
            assert handle.topology == expected(handle.host, TOPOLOGY_LABELS), handle
        new = k8s.replace(handles[0].node_id, exclude_host=True)
        assert new.host not in {h.host for h in handles}, new
        assert new.topology == expected(new.host, TOPOLOGY_LABELS), new
        seen = [*handles, new]
        assert {h.host for h in seen} == set(LABELS)
        assert next(h for h in seen if h.host == "kube-c").topology == {}
        assert next(h for h in seen if h.host == "kube-a").topology == {
            "switch": "s1",
            "zone": "z1",
        }
    finally:
        k8s.stop()


def test_the_option_picks_which_node_labels_are_the_topology(
    cluster: EmulatedCluster, spec: LaunchSpec
) -> None:
    wanted = {"rack": "example.com/rack", "switch": SWITCH}
    k8s = cluster.scheduler(topology_labels=wanted)
    try:
        handles = k8s.launch(spec, 3)
        assert {h.host: h.topology for h in handles} == {
            "kube-a": {"rack": "r1", "switch": "s1"},
            "kube-b": {"switch": "s2"},
            "kube-c": {},
        }
    finally:
        k8s.stop()


def test_nodes_that_cannot_be_read_are_an_error_of_the_launch(
    cluster: EmulatedCluster, spec: LaunchSpec
) -> None:
    """The scheduler watches the cluster's nodes (a NotReady node loses its pods; the labels
    come from the same watch): without the right to list them it cannot launch, and says why,
    before any pod is made."""
    k8s = cluster.scheduler(request_timeout=2)
    cluster.forbid("list", "nodes")
    try:
        with pytest.raises(SchedulerError, match=r"cannot list the nodes .*Forbidden"):
            k8s.launch(spec, 1)
    finally:
        cluster.allow("list", "nodes")
        k8s.stop()
    assert [
        p for p in cluster.objects("pods") if p["metadata"]["name"].startswith(spec.run_id)
    ] == []
