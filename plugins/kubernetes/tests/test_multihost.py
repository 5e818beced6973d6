"""``planaria run`` with the kubernetes scheduler over nodes that are hosts of their own: each
emulated node a network namespace with its own address, the API server and the master on this
machine, reached by the nodes over the bridge at its address there. examples/train_gpt.py runs
on 2 pods over gloo, TLS on (the default off loopback), the master bound to ``0.0.0.0`` without
``master.advertise``: it must find the address the nodes reach it at from the nodes'
``InternalIP``. Rank 1's pod is deleted with no grace mid-training (its node's processes die at
once); the replacement runs on the third host and the job ends with bitwise the weights of a
run without a fault."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from planaria.master.journal import Journal
from planaria.protocol import MASTER_ENV
from planaria.testing import netns
from planaria.testing.jobs import final_weights, job_events, paused_run, wait_for, write_job
from planaria_kubernetes import pods
from planaria_kubernetes.testing import EmulatedCluster
from planaria_kubernetes.testing.jobs import job_objects, listen_for_nodes, scheduler_section

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    netns.unavailable() is not None, reason=f"nodes cannot be hosts here: {netns.unavailable()}"
)

NODES = ("host-a", "host-b", "host-c")
JOB = "k8s-hosts"


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmulatedCluster]:
    with EmulatedCluster(nodes=NODES, hosts=True) as emulated:
        yield emulated
        assert emulated.errors == []


def pod_addresses(cluster: EmulatedCluster) -> dict[str, tuple[str, str, str]]:
    """Each running pod of the job: (its node, its podIP, the master URL it was given)."""
    found = {}
    for pod in job_objects(cluster, "pods", JOB):
        if pod.get("status", {}).get("phase") != "Running":
            continue
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env") or []}
        node = pod["spec"]["nodeName"]
        found[pod["metadata"]["name"]] = (node, pod["status"]["podIP"], str(env.get(MASTER_ENV)))
    return found


def test_a_lost_host_is_replaced_on_a_third_one_and_training_ends_bitwise_equal(
    tmp_path: Path, cluster: EmulatedCluster, train_gpt: list[str], clean_weights: dict[str, Any]
) -> None:
    assert cluster.network is not None
    host = cluster.host_address
    internal = {node: cluster.node_address(node) for node in NODES}
    assert len(set(internal.values())) == len(NODES), internal
    config = write_job(tmp_path, JOB, train_gpt, scheduler_section(cluster, tmp_path))
    listen_for_nodes(config, cluster)
    seen: dict[str, tuple[str, str, str]] = {}
    with paused_run(tmp_path, config) as run:
        seen.update(pod_addresses(cluster))
        assert len(seen) == 2, seen
        (first_round, *_) = [e for e in job_events(tmp_path) if e["kind"] == "rendezvous_completed"]
        ranks = first_round["data"]["ranks"]
        victim_node = next(node for node, rank in ranks.items() if int(rank) == 1)
        (run_dir,) = tmp_path.glob("planaria-runs/*")
        victim = pods.dns_label(f"{run_dir.name}-{victim_node}")
        lost_host = seen[victim][0]
        free = set(NODES) - {node for node, _, _ in seen.values()}
        # The host is lost: its pod is deleted at once, its processes killed (grace 0).
        core = kubernetes.client.CoreV1Api(cluster.api())
        core.delete_namespaced_pod(victim, cluster.namespace, grace_period_seconds=0)

        def replaced() -> dict[str, Any] | None:
            return next((e for e in job_events(tmp_path) if e["kind"] == "node_replaced"), None)

        event = wait_for("the replacement", replaced, timeout=90)
        new_pod = pods.dns_label(f"{run_dir.name}-{event['data']['replacement']}")

        def running() -> dict[str, tuple[str, str, str]]:
            return {k: v for k, v in pod_addresses(cluster).items() if k == new_pod}

        seen.update(wait_for("the replacement running", running, timeout=60))
        output, _ = run.communicate(timeout=240)
    assert run.returncode == 0, output
    assert "succeeded" in output
    faults = [e for e in job_events(tmp_path) if e["kind"] == "fault_detected"]
    assert any(e["node"] == victim_node for e in faults), faults
    # The replacement runs on the third host, never on the lost one.
    assert seen[new_pod][0] in free and seen[new_pod][0] != lost_host, (seen, free)
    # Three pods, three hosts, three addresses: each its node's InternalIP.
    assert len({ip for _, ip, _ in seen.values()}) == 3, seen
    assert all(ip == internal[node] for node, ip, _ in seen.values()), (seen, internal)
    # The master chose the address this machine has on the nodes' network, said why, and its
    # agents were told it, over TLS: never 127.0.0.1 or 0.0.0.0.
    told = re.search(r"agents are told the master is at (\S+): (.*)", output)
    assert told is not None, output
    assert told[1] == host and host.startswith(f"{netns.SUBNET}.")
    assert "reaches the nodes from" in told[2], told[2]
    urls = {url for _, _, url in seen.values()}
    assert len(urls) == 1 and urls.pop().startswith(f"https://{host}:"), seen
    journal = Journal.read(run_dir)
    assert journal.meta["server"]["advertise"] == host, journal.meta["server"]
    # Each agent reached it from its own host: the master heard each at its node's address,
    # and the workers' rendezvous is at rank 0's.
    heard = {node: (n["host"], n["addr"]) for node, n in journal.nodes.items()}
    assert heard[victim_node][0] == lost_host, heard
    assert all(addr == internal[on] for on, addr in heard.values()), (heard, internal)
    assert len({addr for _, addr in heard.values()}) == 3, heard
    world = journal.parts["rounds"]["world"]
    rank0 = next(node for node, w in world.items() if w["node_rank"] == 0)
    assert {w["master_addr"] for w in world.values()} == {heard[rank0][1]}, world
    # Nothing of the job is left on the cluster.
    assert job_objects(cluster, "pods", JOB) == []
    assert job_objects(cluster, "secrets", JOB) == []
    final = final_weights(tmp_path)
    assert final.keys() == clean_weights.keys()
    assert all(torch.equal(final[k], clean_weights[k]) for k in final)
