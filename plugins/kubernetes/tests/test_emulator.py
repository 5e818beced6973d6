"""The emulated cluster, exercised through the official ``kubernetes`` client only."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from kubernetes.client import CoreV1Api
from kubernetes.client.exceptions import ApiException

from planaria.process import running
from planaria.testing import netns
from planaria_kubernetes.testing import EmulatedCluster

NS = "planaria"
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
NOWHERE = {"emulator-test/nowhere": "true"}  # a nodeSelector no node matches: stays Pending


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatedCluster]:
    with EmulatedCluster(log_dir=tmp_path_factory.mktemp("pods")) as running:
        yield running
        assert running.errors == []


@pytest.fixture(scope="module")
def v1(cluster: EmulatedCluster) -> CoreV1Api:
    return CoreV1Api(cluster.api())


def pod(
    name: str,
    command: list[str],
    *,
    labels: dict[str, str] | None = None,
    image: str = "busybox:1.36",
    **spec: Any,
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": image, "command": command}],
            **spec,
        },
    }


def message(exc: pytest.ExceptionInfo[ApiException]) -> str:
    """The ``message`` of the ``Status`` an API error carries."""
    return str(json.loads(exc.value.body)["message"])


def phase(cluster: EmulatedCluster, name: str) -> str | None:
    obj = cluster.pod(name)
    return None if obj is None else obj["status"].get("phase")


def wait_phase(cluster: EmulatedCluster, name: str, wanted: str, timeout: float = 10) -> None:
    cluster.wait(lambda: phase(cluster, name) == wanted, timeout, f"pod {name} {wanted}")


def watch_events(v1: CoreV1Api, kind: str, **kwargs: Any) -> list[tuple[str, str]]:
    """(type, name) of every event of a bounded watch."""
    func = getattr(v1, f"list_namespaced_{kind}")
    return [
        (event["type"], event["object"].metadata.name)
        for event in kubernetes.watch.Watch().stream(func, NS, **kwargs)
    ]


def test_create_list_selectors_and_errors(cluster: EmulatedCluster, v1: CoreV1Api) -> None:
    created = [
        v1.create_namespaced_pod(NS, pod(f"sel-{i}", SLEEP, labels=labels, node_selector=NOWHERE))
        for i, labels in enumerate(
            [{"sel": "a", "tier": "x"}, {"sel": "b", "tier": "y"}, {"sel": "c"}]
        )
    ]
    uids = {p.metadata.uid for p in created}
    assert len(uids) == 3 and all(p.metadata.creation_timestamp for p in created)
    versions = [int(p.metadata.resource_version) for p in created]
    assert versions == sorted(versions)

    def names(**kwargs: Any) -> list[str]:
        return [p.metadata.name for p in v1.list_namespaced_pod(NS, **kwargs).items]

    assert names(label_selector="sel=a") == ["sel-0"]
    assert names(label_selector="sel,sel!=a") == ["sel-1", "sel-2"]
    assert names(label_selector="sel in (a,c),!tier") == ["sel-2"]
    assert names(label_selector="sel notin (a),tier") == ["sel-1"]
    assert names(label_selector="sel", field_selector="metadata.name=sel-1") == ["sel-1"]
    assert names(label_selector="sel", field_selector="status.phase!=Pending") == []
    listed = v1.list_namespaced_pod(NS, label_selector="sel")
    assert listed.kind == "PodList" and int(listed.metadata.resource_version) >= versions[-1]

    generated = v1.create_namespaced_secret(
        NS, {"metadata": {"generateName": "gen-"}, "stringData": {"k": "v"}}
    )
    assert generated.metadata.name.startswith("gen-") and len(generated.metadata.name) == 9
    assert generated.data == {"k": base64.b64encode(b"v").decode()}

    with pytest.raises(ApiException) as exists:
        v1.create_namespaced_pod(NS, pod("sel-0", SLEEP))
    assert exists.value.status == 409 and message(exists) == 'pods "sel-0" already exists'
    with pytest.raises(ApiException) as missing:
        v1.read_namespaced_pod("nope", NS)
    assert missing.value.status == 404 and message(missing) == 'pods "nope" not found'
    with pytest.raises(ApiException) as bad:
        v1.create_namespaced_pod(NS, {"metadata": {"name": "x"}, "spec": {"containers": []}})
    assert bad.value.status == 422
    assert message(bad) == 'Pod "x" is invalid: spec.containers: Required value'
    with pytest.raises(ApiException) as bad_name:
        v1.create_namespaced_pod(NS, pod("Bad_Name", SLEEP))
    assert bad_name.value.status == 422

    # Merge patches delete with null; JSON patches; the status subresource changes status only.
    v1.patch_namespaced_pod("sel-0", NS, {"metadata": {"labels": {"tier": None, "new": "1"}}})
    v1.patch_namespaced_pod(
        "sel-0", NS, [{"op": "add", "path": "/metadata/labels/j", "value": "2"}]
    )
    labels = v1.read_namespaced_pod("sel-0", NS).metadata.labels
    assert labels == {"sel": "a", "new": "1", "j": "2"}
    v1.patch_namespaced_pod("sel-0", NS, {"status": {"phase": "Succeeded"}})
    assert v1.read_namespaced_pod("sel-0", NS).status.phase == "Pending"
    v1.patch_namespaced_pod_status("sel-0", NS, {"status": {"message": "hi"}})
    assert v1.read_namespaced_pod("sel-0", NS).status.message == "hi"

    event = kubernetes.client.CoreV1Event(
        metadata=kubernetes.client.V1ObjectMeta(generate_name="sel-0."),
        involved_object=kubernetes.client.V1ObjectReference(kind="Pod", name="sel-0", namespace=NS),
        reason="Testing",
        message="an event",
        type="Normal",
    )
    v1.create_namespaced_event(NS, event)
    events = v1.list_namespaced_event(NS, field_selector="involvedObject.name=sel-0").items
    assert {e.reason for e in events} == {"Testing", "FailedScheduling"}
    events = v1.list_namespaced_event(NS, field_selector="involvedObject.name=sel-0,type!=Warning")
    assert [e.message for e in events.items] == ["an event"]

    for p in created:
        v1.delete_namespaced_pod(p.metadata.name, NS)
    v1.delete_namespaced_secret(generated.metadata.name, NS)
    assert names(label_selector="sel") == []


def test_watch_from_resource_version(v1: CoreV1Api) -> None:
    start = v1.list_namespaced_config_map(NS).metadata.resource_version
    v1.create_namespaced_config_map(NS, {"metadata": {"name": "w1", "labels": {"w": "1"}}})
    v1.create_namespaced_config_map(NS, {"metadata": {"name": "w2", "labels": {"w": "1"}}})
    v1.patch_namespaced_config_map("w1", NS, {"data": {"a": "b"}})
    v1.patch_namespaced_config_map("w2", NS, {"metadata": {"labels": {"w": "2"}}})
    v1.delete_namespaced_config_map("w1", NS)

    events = watch_events(v1, "config_map", resource_version=start, timeout_seconds=1)
    assert events == [
        ("ADDED", "w1"),
        ("ADDED", "w2"),
        ("MODIFIED", "w1"),
        ("MODIFIED", "w2"),
        ("DELETED", "w1"),
    ]
    # With a selector, the change that makes w2 stop matching is seen as its deletion.
    events = watch_events(
        v1, "config_map", resource_version=start, label_selector="w=1", timeout_seconds=1
    )
    assert events == [
        ("ADDED", "w1"),
        ("ADDED", "w2"),
        ("MODIFIED", "w1"),
        ("DELETED", "w2"),
        ("DELETED", "w1"),
    ]
    # Without a version: the current objects, as ADDED.
    assert watch_events(v1, "config_map", timeout_seconds=1) == [("ADDED", "w2")]
    v1.delete_namespaced_config_map("w2", NS)


def test_expired_watch_gets_410_then_relist_works(cluster: EmulatedCluster, v1: CoreV1Api) -> None:
    """``Watch().stream`` meets the ``ERROR`` event with code 410: it retries once from the same
    version when no ``timeout_seconds`` was given, and raises ``ApiException(status=410)`` on the
    second 410 (at once with ``timeout_seconds``). A client recovers by relisting."""
    stale = v1.list_namespaced_secret(NS).metadata.resource_version
    failures: list[ApiException] = []

    def open_watch() -> None:
        try:
            for _ in kubernetes.watch.Watch().stream(
                v1.list_namespaced_secret, NS, resource_version=stale
            ):
                pass
        except ApiException as exc:
            failures.append(exc)

    watcher = threading.Thread(target=open_watch)
    watcher.start()
    cluster.wait(lambda: any("watch=true" in path for _, path in cluster.requests), 5, "watch")
    cluster.expire_watches()
    watcher.join(10)
    assert not watcher.is_alive()
    assert [f.status for f in failures] == [410]
    assert "Expired: too old resource version" in str(failures[0].reason)

    with pytest.raises(ApiException) as gone:
        watch_events(v1, "secret", resource_version=stale, timeout_seconds=1)
    assert gone.value.status == 410

    fresh = v1.list_namespaced_secret(NS).metadata.resource_version
    v1.create_namespaced_secret(NS, {"metadata": {"name": "after-expiry"}})
    events = watch_events(v1, "secret", resource_version=fresh, timeout_seconds=1)
    assert events == [("ADDED", "after-expiry")]
    v1.delete_namespaced_secret("after-expiry", NS)


def test_exit_code_and_kill_from_outside(cluster: EmulatedCluster, v1: CoreV1Api) -> None:
    start = v1.list_namespaced_pod(NS).metadata.resource_version
    v1.create_namespaced_pod(NS, pod("exit3", [sys.executable, "-c", "import sys; sys.exit(3)"]))
    v1.create_namespaced_pod(NS, pod("sleeper", SLEEP))
    wait_phase(cluster, "exit3", "Failed")
    printer = [sys.executable, "-c", "print('line 1'); print('line 2')"]
    v1.create_namespaced_pod(NS, pod("printer", printer))
    wait_phase(cluster, "printer", "Succeeded")
    assert v1.read_namespaced_pod_log("printer", NS) == "line 1\nline 2\n"
    assert v1.read_namespaced_pod_log("printer", NS, tail_lines=1) == "line 2\n"
    phases = [
        event["object"].status.phase
        for event in kubernetes.watch.Watch().stream(
            v1.list_namespaced_pod,
            NS,
            resource_version=start,
            timeout_seconds=1,
            field_selector="metadata.name=exit3",
        )
    ]
    assert phases[0] == "Pending" and phases[-1] == "Failed" and "Running" in phases
    status = v1.read_namespaced_pod("exit3", NS).status
    terminated = status.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason) == (3, "Error")

    wait_phase(cluster, "sleeper", "Running")
    running = v1.read_namespaced_pod("sleeper", NS)
    assert running.spec.node_name.startswith("kube-")
    assert running.status.pod_ip == cluster.node_address(running.spec.node_name)
    assert [c.status for c in running.status.conditions if c.type == "Ready"] == ["True"]
    pids = cluster.pod_pids("sleeper")
    assert pids
    os.kill(pids[0], signal.SIGKILL)
    wait_phase(cluster, "sleeper", "Failed")
    terminated = v1.read_namespaced_pod("sleeper", NS).status.container_statuses[0].state.terminated
    assert terminated.exit_code == 137
    assert cluster.pod_pids("sleeper") == []
    for name in ("exit3", "sleeper", "printer"):
        v1.delete_namespaced_pod(name, NS)


def test_env_from_secret_and_fields(
    cluster: EmulatedCluster, v1: CoreV1Api, tmp_path: Path
) -> None:
    out = tmp_path / "env.txt"
    script = (
        "import os, pathlib; pathlib.Path(os.environ['OUT']).write_text("
        "'|'.join(os.environ[k] for k in ('TOKEN', 'POD', 'NODE', 'PATH_MARK')))"
    )
    body = pod("env", [sys.executable, "-c", script])
    body["spec"]["containers"][0]["env"] = [
        {"name": "OUT", "value": str(out)},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "PATH_MARK", "value": "$(POD)-x"},
    ]
    v1.create_namespaced_pod(NS, body)

    def waiting_reason() -> str | None:
        statuses = (cluster.pod("env") or {}).get("status", {}).get("containerStatuses") or []
        return statuses[0]["state"].get("waiting", {}).get("message") if statuses else None

    waiting = cluster.wait(waiting_reason, 10, "CreateContainerConfigError")
    assert waiting == 'secret "creds" not found'
    secret = {
        "metadata": {"name": "creds"},
        "data": {"token": base64.b64encode(b"s3cr3t").decode()},
    }
    v1.create_namespaced_secret(NS, secret)
    wait_phase(cluster, "env", "Succeeded")
    node = v1.read_namespaced_pod("env", NS).spec.node_name
    assert out.read_text() == f"s3cr3t|env|{node}|env-x"
    v1.delete_namespaced_pod("env", NS)
    v1.delete_namespaced_secret("creds", NS)


HOST_PROBE = """
import json, os, pathlib, socket, sys, time, urllib.request
out, port, url, peers = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
server = socket.create_server(("0.0.0.0", port))  # every node's pod takes the same port
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect((url.split("//")[1].split(":")[0], 9))
with urllib.request.urlopen(url + "/api/v1/namespaces/planaria/pods/" + os.environ["POD"]) as r:
    seen = json.load(r)["status"]["podIP"]
(out / os.environ["POD"]).write_text(json.dumps({
    "source": probe.getsockname()[0], "env": os.environ["POD_IP"], "api": seen,
    "host": os.environ["HOST_IP"]}))
while len(list(out.iterdir())) < peers:  # hold the port until every node's pod holds it
    time.sleep(0.05)
"""


def test_every_node_is_a_host_of_its_own(
    cluster: EmulatedCluster, v1: CoreV1Api, tmp_path: Path
) -> None:
    """Each node's pods run in its network namespace: the node's InternalIP, the pod's podIP
    (in its status and through the downward API) and the address it sends from are one, and
    differ from node to node; a pod reaches the API server at the cluster's URL; the pods of
    three nodes hold the same port at once."""
    if cluster.network is None:
        pytest.skip(f"nodes are not hosts of their own here: {netns.unavailable()}")
    nodes = {n.metadata.name: n for n in v1.list_node().items}
    internal = {
        name: next(a.address for a in n.status.addresses if a.type == "InternalIP")
        for name, n in nodes.items()
    }
    assert len(set(internal.values())) == len(nodes) == 3, internal
    assert all(a.startswith(f"{netns.SUBNET}.") for a in internal.values()), internal
    assert cluster.url.startswith(f"http://{cluster.host_address}:")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]  # free here; each namespace has its own ports anyway
    for node in nodes:
        body = pod(
            f"probe-{node}",
            [sys.executable, "-c", HOST_PROBE, str(tmp_path), str(port), cluster.url, "3"],
            nodeSelector={"kubernetes.io/hostname": node},
        )
        body["spec"]["containers"][0]["env"] = [
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
        ]
        v1.create_namespaced_pod(NS, body)
    for node in nodes:
        wait_phase(cluster, f"probe-{node}", "Succeeded", timeout=30)
        seen = json.loads((tmp_path / f"probe-{node}").read_text())
        assert set(seen.values()) == {internal[node]}, (node, seen)
        assert v1.read_namespaced_pod(f"probe-{node}", NS).status.pod_ip == internal[node]
        v1.delete_namespaced_pod(f"probe-{node}", NS)


def test_scheduling_constraints(cluster: EmulatedCluster, v1: CoreV1Api) -> None:
    not_in = pod(
        "not-ab",
        SLEEP,
        affinity={
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {
                                    "key": "kubernetes.io/hostname",
                                    "operator": "NotIn",
                                    "values": ["kube-a", "kube-b"],
                                }
                            ],
                        }
                    ]
                },
            }
        },
    )
    v1.create_namespaced_pod(NS, not_in)
    cluster.wait(lambda: (cluster.pod("not-ab") or {})["spec"].get("nodeName"), 5, "binding")
    assert v1.read_namespaced_pod("not-ab", NS).spec.node_name == "kube-c"
    v1.delete_namespaced_pod("not-ab", NS, grace_period_seconds=0)

    spread = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {"app": "spread"}},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    }
    for i in range(4):
        v1.create_namespaced_pod(
            NS, pod(f"spread-{i}", SLEEP, labels={"app": "spread"}, affinity=spread)
        )

    def refused() -> dict[str, Any] | None:
        for condition in (cluster.pod("spread-3") or {}).get("status", {}).get("conditions", []):
            if condition["type"] == "PodScheduled" and condition["status"] == "False":
                return dict(condition)
        return None

    condition = cluster.wait(refused, 5, "spread-3 unschedulable")
    assert condition["reason"] == "Unschedulable"
    assert condition["message"] == (
        "0/3 nodes are available: 3 node(s) didn't match pod anti-affinity rules."
    )
    nodes = {v1.read_namespaced_pod(f"spread-{i}", NS).spec.node_name for i in range(3)}
    assert nodes == {"kube-a", "kube-b", "kube-c"}
    assert phase(cluster, "spread-3") == "Pending"
    events = v1.list_namespaced_event(NS, field_selector="type=Warning").items
    assert any(
        e.reason == "FailedScheduling" and e.involved_object.name == "spread-3" for e in events
    )

    gpu = pod("gpu", SLEEP)
    gpu["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    v1.create_namespaced_pod(NS, gpu)
    cluster.wait(lambda: "Insufficient nvidia.com/gpu" in str(cluster.pod("gpu")), 5, "gpu")
    assert v1.read_namespaced_pod("gpu", NS).status.qos_class == "Burstable"
    for name in ("gpu", *(f"spread-{i}" for i in range(4))):
        v1.delete_namespaced_pod(name, NS, grace_period_seconds=0)


def test_bad_image(cluster: EmulatedCluster, v1: CoreV1Api) -> None:
    cluster.bad_image("registry.invalid/nope:1")
    v1.create_namespaced_pod(NS, pod("badimg", SLEEP, image="registry.invalid/nope:1"))

    def reason() -> str | None:
        statuses = (cluster.pod("badimg") or {}).get("status", {}).get("containerStatuses") or []
        return statuses[0]["state"].get("waiting", {}).get("reason") if statuses else None

    cluster.wait(lambda: reason() == "ImagePullBackOff", 5, "ImagePullBackOff")
    status = v1.read_namespaced_pod("badimg", NS).status
    assert status.phase == "Pending"
    assert "registry.invalid/nope:1" in status.container_statuses[0].state.waiting.message
    v1.delete_namespaced_pod("badimg", NS)
    cluster.wait(lambda: cluster.pod("badimg") is None, 5, "removal")


def test_delete_running_pod_stops_it(cluster: EmulatedCluster, v1: CoreV1Api) -> None:
    v1.create_namespaced_pod(NS, pod("victim", SLEEP, termination_grace_period_seconds=5))
    wait_phase(cluster, "victim", "Running")
    pids = cluster.pod_pids("victim")
    start = v1.list_namespaced_pod(NS).metadata.resource_version
    deleted = v1.delete_namespaced_pod("victim", NS)
    assert deleted.metadata.deletion_timestamp is not None
    assert deleted.metadata.deletion_grace_period_seconds == 5
    events = kubernetes.watch.Watch().stream(
        v1.list_namespaced_pod,
        NS,
        resource_version=start,
        timeout_seconds=10,
        field_selector="metadata.name=victim",
    )
    seen = []
    for event in events:
        seen.append(event["type"])
        if event["type"] == "DELETED":
            break
    assert seen[0] == "MODIFIED" and seen[-1] == "DELETED"
    assert pids and not [pid for pid in pids if running(pid)]


def test_forced_deletion_and_preconditions(cluster: EmulatedCluster, v1: CoreV1Api) -> None:
    created = v1.create_namespaced_pod(NS, pod("forced", SLEEP))
    wait_phase(cluster, "forced", "Running")
    pids = cluster.pod_pids("forced")
    with pytest.raises(ApiException) as stale:
        v1.delete_namespaced_pod(
            "forced", NS, body={"preconditions": {"uid": "not-" + created.metadata.uid}}
        )
    assert stale.value.status == 409 and "Precondition failed: UID" in message(stale)
    v1.delete_namespaced_pod(
        "forced", NS, grace_period_seconds=0, body={"preconditions": {"uid": created.metadata.uid}}
    )
    assert cluster.pod("forced") is None  # gone at once; the kubelet then kills its processes
    cluster.wait(lambda: not [pid for pid in pids if running(pid)], 5, "the processes killed")


def test_bookmarks(cluster: EmulatedCluster, v1: CoreV1Api) -> None:
    cluster.server.bookmark_interval = 0.2
    try:
        stream = kubernetes.watch.Watch().stream(
            v1.list_namespaced_secret,
            NS,
            resource_version=v1.list_namespaced_secret(NS).metadata.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=2,
        )
        first = next(iter(stream))
    finally:
        cluster.server.bookmark_interval = 5.0
    assert first["type"] == "BOOKMARK"
    assert int(first["raw_object"]["metadata"]["resourceVersion"]) > 0


def test_owner_deletion_cascades(cluster: EmulatedCluster, v1: CoreV1Api) -> None:
    owner = v1.create_namespaced_secret(NS, {"metadata": {"name": "owner"}})

    def owned_by(obj: Any) -> list[dict[str, Any]]:
        meta = obj.metadata
        return [
            {"apiVersion": "v1", "kind": type(obj).__name__[2:], "name": meta.name, "uid": meta.uid}
        ]

    child = pod("child", SLEEP, node_selector=NOWHERE)
    child["metadata"]["ownerReferences"] = owned_by(owner)
    child = v1.create_namespaced_pod(NS, child)
    grandchild = {"metadata": {"name": "grandchild", "ownerReferences": owned_by(child)}}
    v1.create_namespaced_config_map(NS, grandchild)
    v1.delete_namespaced_secret("owner", NS)
    cluster.wait(lambda: not cluster.objects("configmaps"), 5, "cascading deletion")
    assert cluster.pod("child") is None


def test_forbidden(cluster: EmulatedCluster, v1: CoreV1Api) -> None:
    cluster.forbid("create", "pods")
    try:
        with pytest.raises(ApiException) as denied:
            v1.create_namespaced_pod(NS, pod("nope", SLEEP))
    finally:
        cluster.allow("create", "pods")
    assert denied.value.status == 403
    assert message(denied) == (
        'pods is forbidden: User "system:serviceaccount:planaria:default" cannot create'
        ' resource "pods" in API group "" in the namespace "planaria"'
    )


def test_cordon_keeps_new_pods_off(cluster: EmulatedCluster, v1: CoreV1Api) -> None:
    start = v1.list_node().metadata.resource_version
    for node in ("kube-a", "kube-b"):
        v1.patch_node(node, {"spec": {"unschedulable": True}})
    try:
        v1.create_namespaced_pod(NS, pod("uncordoned", SLEEP))
        cluster.wait(lambda: (cluster.pod("uncordoned") or {})["spec"].get("nodeName"), 5, "bind")
        assert v1.read_namespaced_pod("uncordoned", NS).spec.node_name == "kube-c"
        assert [n.metadata.name for n in v1.list_node().items if n.spec.unschedulable] == [
            "kube-a",
            "kube-b",
        ]
    finally:
        for node in ("kube-a", "kube-b"):
            v1.patch_node(node, {"spec": {"unschedulable": None}})
    node_events = [
        (event["type"], event["object"].metadata.name, event["object"].spec.unschedulable)
        for event in kubernetes.watch.Watch().stream(
            v1.list_node, resource_version=start, timeout_seconds=1
        )
    ]
    assert node_events == [
        ("MODIFIED", "kube-a", True),
        ("MODIFIED", "kube-b", True),
        ("MODIFIED", "kube-a", None),
        ("MODIFIED", "kube-b", None),
    ]
    v1.delete_namespaced_pod("uncordoned", NS, grace_period_seconds=0)


def test_not_ready_node(tmp_path: Path) -> None:
    with EmulatedCluster(("only",), log_dir=tmp_path) as cluster:
        v1 = CoreV1Api(cluster.api())
        v1.create_namespaced_pod(NS, pod("stranded", SLEEP))
        wait_phase(cluster, "stranded", "Running")
        cluster.set_node_ready("only", False, kill=True)
        ready = next(c for c in v1.read_node("only").status.conditions if c.type == "Ready")
        assert (ready.status, ready.reason) == ("Unknown", "NodeStatusUnknown")
        status = v1.read_namespaced_pod("stranded", NS).status
        assert [c.status for c in status.conditions if c.type == "Ready"] == ["False"]
        assert status.phase == "Running"  # nobody reports for a dead node
        v1.create_namespaced_pod(NS, pod("newcomer", SLEEP))
        cluster.wait(lambda: "untolerated taint" in str(cluster.pod("newcomer")), 5, "refusal")
        assert "{node.kubernetes.io/unreachable: }" in str(cluster.pod("newcomer"))
        v1.delete_namespaced_pod("stranded", NS)
        assert cluster.pod("stranded") is not None  # stuck terminating: no kubelet to finish it
        cluster.set_node_ready("only", True)
        cluster.wait(lambda: cluster.pod("stranded") is None, 5, "removal once back")
        wait_phase(cluster, "newcomer", "Running")


def test_nothing_left_running_after_stop(tmp_path: Path) -> None:
    threads = set(threading.enumerate())
    with EmulatedCluster(("solo",), log_dir=tmp_path) as cluster:
        v1 = CoreV1Api(cluster.api())
        # A process with a child of its own, in the same process group.
        v1.create_namespaced_pod(NS, pod("family", ["sh", "-c", "sleep 60 & sleep 60; wait"]))
        cluster.wait(lambda: len(cluster.pod_pids("family")) >= 2, 10, "both processes")
        pids = cluster.pod_pids("family")
        network = cluster.network
        spaces = [m.netns for m in network.members.values()] + [network.hub] if network else []
        link = network.host_link if network else ""
    assert len(pids) >= 2 and not [pid for pid in pids if running(pid)]
    assert set(threading.enumerate()) <= threads
    host, port = cluster.url.removeprefix("http://").split(":")
    # Refused, or (its network gone with it) unreachable.
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=1)
    assert cluster.network is None
    assert not [name for name in spaces if (netns.NETNS_DIR / name).exists()], spaces
    if link:
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
        assert link not in links.stdout
