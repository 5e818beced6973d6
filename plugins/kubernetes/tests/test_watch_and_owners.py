"""The scheduler against the emulated cluster, below the master: no change is missed when a
watch expires (410 Gone), a node diagnosed faulty is avoided and cordoned, and the pods belong
to their owner (deleting it deletes the job)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from planaria.errors import SchedulerError
from planaria.scheduler.api import LaunchSpec, NodeEvent, NodeState
from planaria_kubernetes import KubernetesOptions, KubernetesScheduler, OwnerRef, pods
from planaria_kubernetes.testing import EmulatedCluster

SLEEP = (sys.executable, "-c", "import time; time.sleep(600)")


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmulatedCluster]:
    with EmulatedCluster(nodes=("kube-a", "kube-b", "kube-c")) as emulated:
        yield emulated


@pytest.fixture
def spec() -> LaunchSpec:
    return LaunchSpec(job="watch", command=SLEEP, run_id=f"watch-{uuid.uuid4().hex[:6]}")


def ends(k8s: KubernetesScheduler, count: int, timeout: float = 30) -> list[NodeEvent]:
    seen: list[NodeEvent] = []
    deadline = time.monotonic() + timeout
    while len([e for e in seen if e.state is not NodeState.RUNNING]) < count:
        assert time.monotonic() < deadline, f"only {seen} within {timeout}s"
        seen += k8s.poll(0.5)
    return [e for e in seen if e.state is not NodeState.RUNNING]


def test_changes_made_while_the_watch_is_expired_are_all_reported(
    cluster: EmulatedCluster, spec: LaunchSpec
) -> None:
    k8s = cluster.scheduler()
    try:
        killed, deleted = k8s.launch(spec, 2)
        informer = k8s._pods_informer
        assert informer is not None
        cluster.expire_watches()
        for pid in cluster.pod_pids(pods.pod_name(spec, killed.node_id)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        core = __import__("kubernetes").client.CoreV1Api(cluster.api())
        core.delete_namespaced_pod(pods.pod_name(spec, deleted.node_id), cluster.namespace)
        events = {e.node_id: e for e in ends(k8s, 2)}
        assert events[killed.node_id].state is NodeState.LOST
        assert "killed by signal 9" in events[killed.node_id].reason
        assert events[deleted.node_id].state is NodeState.LOST
        assert "delete" in events[deleted.node_id].reason
        assert informer.relists >= 1, "the expired watch was not followed by a list"
    finally:
        k8s.stop()


def test_a_node_diagnosed_faulty_is_avoided_and_cordoned(
    cluster: EmulatedCluster, spec: LaunchSpec
) -> None:
    k8s = cluster.scheduler(cordon=True)
    core = __import__("kubernetes").client.CoreV1Api(cluster.api())
    try:
        old, _ = k8s.launch(spec, 2)
        new = k8s.replace(old.node_id, exclude_host=True)
        assert new.host not in (old.host, "pending")
        node = next(n for n in cluster.objects("nodes") if n["metadata"]["name"] == old.host)
        assert node["spec"].get("unschedulable") is True
        assert k8s.excluded_hosts() == {old.host}
    finally:
        k8s.stop()
        for node in cluster.objects("nodes"):
            core.patch_node(node["metadata"]["name"], {"spec": {"unschedulable": None}})


def test_node_addresses_are_the_internal_ips_of_the_nodes_pods_may_go_to(
    cluster: EmulatedCluster,
) -> None:
    """What a master bound to every interface takes its address from: the InternalIP of each
    Ready, schedulable node that the node selector admits; none when the cluster cannot be
    reached (never an error)."""
    core = __import__("kubernetes").client.CoreV1Api(cluster.api())
    every = [cluster.node_address(n) for n in ("kube-a", "kube-b", "kube-c")]
    assert sorted(cluster.scheduler().node_addresses()) == sorted(set(every))
    core.patch_node("kube-a", {"spec": {"unschedulable": True}})
    try:
        assert sorted(cluster.scheduler().node_addresses()) == sorted(set(every[1:]))
    finally:
        core.patch_node("kube-a", {"spec": {"unschedulable": None}})
    selected = {"kubernetes.io/hostname": "kube-c"}
    assert cluster.scheduler(node_selector=selected).node_addresses() == [every[2]]
    broken = KubernetesOptions(image="planaria-test:1", kubeconfig=str(cluster.kubeconfig) + "x")
    assert KubernetesScheduler(broken).node_addresses() == []


def test_a_cordon_the_master_may_not_do_is_only_a_warning(
    cluster: EmulatedCluster, spec: LaunchSpec
) -> None:
    k8s = cluster.scheduler(cordon=True)
    cluster.forbid("patch", "nodes")
    try:
        old, _ = k8s.launch(spec, 2)
        new = k8s.replace(old.node_id, exclude_host=True)
        assert new.host != old.host
        assert not any(n["spec"].get("unschedulable") for n in cluster.objects("nodes"))
    finally:
        cluster.allow("patch", "nodes")
        k8s.stop()


def test_deleting_the_owner_deletes_the_job(cluster: EmulatedCluster, spec: LaunchSpec) -> None:
    client = __import__("kubernetes").client
    core = client.CoreV1Api(cluster.api())
    owner = core.create_namespaced_config_map(
        cluster.namespace,
        client.V1ConfigMap(metadata=client.V1ObjectMeta(name=f"owner-{spec.run_id}")),
    )
    ref = OwnerRef(
        api_version="v1", kind="ConfigMap", name=owner.metadata.name, uid=owner.metadata.uid
    )
    k8s = cluster.scheduler(owner=ref)
    try:
        (node,) = k8s.launch(spec, 1)
        pod = cluster.pod(pods.pod_name(spec, node.node_id))
        assert pod is not None
        assert pod["metadata"]["ownerReferences"][0]["uid"] == owner.metadata.uid
        core.delete_namespaced_config_map(owner.metadata.name, cluster.namespace)
        (event,) = ends(k8s, 1)
        assert event.state is NodeState.LOST and "delet" in event.reason
        cluster.wait(lambda: cluster.pod(pods.pod_name(spec, node.node_id)) is None, 30, "pod gone")
        secrets = [s["metadata"]["name"] for s in cluster.objects("secrets")]
        assert pods.secret_name(spec) not in secrets
    finally:
        k8s.stop()


def test_pods_of_a_node_gone_not_ready_or_evicted_are_lost(
    cluster: EmulatedCluster, spec: LaunchSpec
) -> None:
    k8s = cluster.scheduler()
    client = __import__("kubernetes").client
    core = client.CoreV1Api(cluster.api())
    try:
        stranded, evicted = k8s.launch(spec, 2)
        cluster.set_node_ready(stranded.host, False)
        # What a kubelet writes when it evicts a pod (node pressure).
        core.patch_namespaced_pod_status(
            pods.pod_name(spec, evicted.node_id),
            cluster.namespace,
            {"status": {"phase": "Failed", "reason": "Evicted", "message": "low on memory"}},
        )
        events = {e.node_id: e for e in ends(k8s, 2)}
        assert events[stranded.node_id].state is NodeState.LOST
        assert f"Kubernetes node {stranded.host} is NotReady" in events[stranded.node_id].reason
        assert events[evicted.node_id].state is NodeState.LOST
        assert "evicted: low on memory" in events[evicted.node_id].reason
    finally:
        cluster.set_node_ready(stranded.host, True)
        k8s.stop()


def test_a_restarted_master_adopts_the_pods_and_sees_one_gone(
    cluster: EmulatedCluster, spec: LaunchSpec
) -> None:
    first = cluster.scheduler()
    handles = first.launch(spec, 3)
    first._disconnect()  # the master died: its pods and Secret live on
    second = cluster.scheduler()
    try:
        kept, gone, out = handles
        # The earlier master had declared `out` lost: the new one deletes its pod.
        handles[2] = out.model_copy(update={"state": NodeState.LOST})
        core = __import__("kubernetes").client.CoreV1Api(cluster.api())
        core.delete_namespaced_pod(pods.pod_name(spec, gone.node_id), cluster.namespace)
        cluster.wait(lambda: cluster.pod(pods.pod_name(spec, gone.node_id)) is None, 30, "gone")
        second.adopt(spec, handles, set())
        (event,) = ends(second, 1)
        assert event.node_id == gone.node_id and event.state is NodeState.LOST
        assert f"its pod {pods.pod_name(spec, gone.node_id)} is gone" in event.reason
        assert cluster.pod_pids(pods.pod_name(spec, kept.node_id))
        out_pod = pods.pod_name(spec, out.node_id)
        cluster.wait(lambda: cluster.pod(out_pod) is None, 30, "the lost node's pod deleted")
        assert second.poll(0.5) == []
        (new,) = second.launch(spec, 1)  # new ids do not reuse an adopted one
        assert new.node_id not in {h.node_id for h in handles}
    finally:
        second.stop()
    assert pods.secret_name(spec) not in [s["metadata"]["name"] for s in cluster.objects("secrets")]


def test_deleting_the_master_s_pod_deletes_the_job(
    cluster: EmulatedCluster, spec: LaunchSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = __import__("kubernetes").client
    core = client.CoreV1Api(cluster.api())
    # The master's pod, as the manifests' Job makes it (kept pending: it runs nothing here).
    master = core.create_namespaced_pod(
        cluster.namespace,
        client.V1Pod(
            metadata=client.V1ObjectMeta(name=f"master-{spec.run_id}"),
            spec=client.V1PodSpec(
                containers=[client.V1Container(name="master", image="planaria-test:1")],
                node_selector={"no-such-label": "x"},
            ),
        ),
    )
    monkeypatch.setenv("PLANARIA_POD_NAME", master.metadata.name)
    k8s = cluster.scheduler()  # owner: auto
    try:
        (node,) = k8s.launch(spec, 1)
        name = pods.pod_name(spec, node.node_id)
        pod = cluster.pod(name)
        assert pod is not None
        assert pod["metadata"]["ownerReferences"][0]["uid"] == master.metadata.uid
        core.delete_namespaced_pod(master.metadata.name, cluster.namespace)
        cluster.wait(lambda: cluster.pod(name) is None, 30, "the job's pod gone with its master")
        secrets = [s["metadata"]["name"] for s in cluster.objects("secrets")]
        assert pods.secret_name(spec) not in secrets
    finally:
        k8s.stop()


def test_a_replacement_with_no_other_node_free_goes_back_to_the_old_one(
    cluster: EmulatedCluster, spec: LaunchSpec
) -> None:
    """One pod per node, every node taken: the replacement, kept off the old node while another
    could take it, finds none, and lands on the old node (not excluded) under its own id."""
    k8s = cluster.scheduler(one_per_node=True)
    try:
        handles = k8s.launch(spec, 3)
        old = handles[0]
        new = k8s.replace(old.node_id, exclude_host=False)
        assert new.node_id == "node-3"
        assert new.host == old.host
        events = []
        deadline = time.monotonic() + 30
        while not any(e.node_id == new.node_id for e in events):
            assert time.monotonic() < deadline, events
            events += k8s.poll(0.5)
        assert [e.state for e in events if e.node_id == new.node_id] == [NodeState.RUNNING]
        assert not [e for e in events if e.node_id == old.node_id]
        pod = cluster.pod(pods.pod_name(spec, new.node_id))
        assert pod is not None and pod["spec"]["nodeName"] == old.host
        assert k8s.excluded_hosts() == set()
    finally:
        k8s.stop()


def test_a_replacement_no_node_can_take_is_an_error_and_leaves_no_pod(
    cluster: EmulatedCluster, spec: LaunchSpec
) -> None:
    """One pod per node, every node taken, the old node excluded: the replacement cannot be
    scheduled, and the error names it and Kubernetes' reason; its pod is deleted."""
    k8s = cluster.scheduler(one_per_node=True, schedule_timeout=1)
    try:
        old, *_ = k8s.launch(spec, 3)
        with pytest.raises(SchedulerError) as raised:
            k8s.replace(old.node_id, exclude_host=True)
        message = str(raised.value)
        assert message.startswith(f"cannot replace {old.node_id}: pod "), message
        assert "could not be scheduled for 1s" in message and "0/3 nodes" in message, message
        assert k8s.excluded_hosts() == {old.host}
        new_pod = pods.pod_name(spec, "node-3")
        cluster.wait(lambda: cluster.pod(new_pod) is None, 30, "the replacement's pod deleted")
    finally:
        k8s.stop()
