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


def scheduler(cluster: EmulatedCluster, **options: object) -> KubernetesScheduler:
    return KubernetesScheduler(
        KubernetesOptions(
            image="planaria-test:1",
            kubeconfig=str(cluster.kubeconfig),
            namespace=cluster.namespace,
            stop_grace=0.5,
            **options,  # type: ignore[arg-type]
        )
    )


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
    k8s = scheduler(cluster)
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
    k8s = scheduler(cluster, cordon=True)
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


def test_a_cordon_the_master_may_not_do_is_only_a_warning(
    cluster: EmulatedCluster, spec: LaunchSpec
) -> None:
    k8s = scheduler(cluster, cordon=True)
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
    k8s = scheduler(cluster, owner=ref)
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
