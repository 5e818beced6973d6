"""A job whose every node is a host of its own: ``planaria run`` of examples/train_gpt.py on 2
Ray nodes of the session's cluster (each raylet in a network namespace of its own, this
machine on their bridge as the driver's node), TLS on, the master bound to every interface
with no ``master.advertise``. The master finds its address towards the nodes itself; one node
is lost mid-training, its replacement runs on a third host, and the final weights are bitwise
those of a run without a fault."""

from __future__ import annotations

import ipaddress
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray_jobs import finished, job, on_ray, paused_run

from planaria.master.journal import Journal
from planaria.testing.jobs import final_weights, job_events, wait_for
from planaria_ray.testing import LocalCluster, sweep_driver_nodes

torch = pytest.importorskip("torch")
ray = pytest.importorskip("ray")
x509 = pytest.importorskip("cryptography.x509")

REGISTERED = re.compile(r"node registered\b.*?\baddr=(\S+).*?\bnode=(node-\d+)")


def test_a_job_over_hosts_of_their_own_survives_a_lost_host_bitwise(
    tmp_path: Path, ray_cluster: LocalCluster, clean_weights: dict
) -> None:
    host = ray_cluster.host_address
    config = job(tmp_path, on_ray(ray_cluster.address))
    with paused_run(tmp_path, config, ray_cluster) as run:
        (run_dir,) = tmp_path.glob("planaria-runs/*")
        first = ray_cluster.ray_node_of(run_dir, "node-0")
        victim = ray_cluster.ray_node_of(run_dir, "node-1")
        # The driver (this test's, as the master's) is seen by Ray at the host address.
        assert ray.util.get_node_ip_address() == host
        where = {n.node_id: n.address for n in ray_cluster.worker_nodes()}
        (spare,) = set(where) - {first, victim}
        ray_cluster.kill_raylet(victim)

        def replaced() -> dict | None:
            return next((e for e in job_events(tmp_path) if e["kind"] == "node_replaced"), None)

        event = wait_for("the replacement", replaced)
        output = finished(run)
    assert run.returncode == 0, output
    assert event["data"]["replacement_host"] == spare, event

    # The master found its address towards the nodes: the host's, on their network.
    flat = " ".join(output.split())
    assert f"agents are told the master is at {host}: the address this machine reaches the " \
        "nodes from" in flat, output  # fmt: skip
    assert f"master at https://{host}:" in flat and "0.0.0.0:" not in flat, output
    server = Journal.read(run_dir).meta["server"]
    assert server["advertise"] == host and server["host"] == "0.0.0.0", server
    (cert,) = run_dir.glob("tls/cert.pem")
    names = (
        x509.load_pem_x509_certificate(cert.read_bytes())
        .extensions.get_extension_for_class(x509.SubjectAlternativeName)
        .value
    )
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address(host)]

    # Each agent registered from its own host's address on that network, never loopback.
    registered = dict((node, addr) for addr, node in REGISTERED.findall(output))
    assert registered == {
        "node-0": where[first],
        "node-1": where[victim],
        "node-2": where[spare],
    }, output
    assert len(set(registered.values())) == 3, registered
    network = ipaddress.ip_network(f"{host}/24", strict=False)
    assert all(ipaddress.ip_address(a) in network for a in registered.values()), registered

    final = final_weights(tmp_path)
    assert final.keys() == clean_weights.keys()
    assert all(torch.equal(final[k], clean_weights[k]) for k in final)


def test_every_ray_node_is_a_host_of_its_own(ray_cluster: LocalCluster) -> None:
    """Ray sees each node, the driver's included, at an address of its own on the bridge's
    network; none at loopback."""
    from planaria_ray.cluster import alive_nodes, join
    from planaria_ray.options import RayOptions

    join(RayOptions(address=ray_cluster.address))
    deadline = time.monotonic() + 30
    while len(nodes := alive_nodes()) < 5 and time.monotonic() < deadline:
        time.sleep(0.5)
    addresses = [n["NodeManagerAddress"] for n in nodes]
    assert len(addresses) == len(set(addresses)) == 5, addresses  # head, 3 agents', driver's
    network = ipaddress.ip_network(f"{ray_cluster.host_address}/24", strict=False)
    assert all(ipaddress.ip_address(a) in network for a in addresses), addresses
    assert ray_cluster.host_address in addresses and ray_cluster.head_address in addresses


def test_driver_nodes_whose_network_is_gone_are_swept(ray_cluster: LocalCluster) -> None:
    """A driver node left by a run killed before its teardown (its address on no interface
    any more) is killed by the next cluster; a live cluster's driver node is not."""
    sleep = "import time; time.sleep(60)"
    orphan = subprocess.Popen(
        [sys.executable, "-c", sleep, "--node-ip-address=10.214.255.254"]
    )  # fmt: skip
    live = subprocess.Popen(
        [sys.executable, "-c", sleep, f"--node_ip_address={ray_cluster.host_address}"]
    )  # fmt: skip
    try:
        if (
            "10.214.255.254"
            in subprocess.run(
                ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True
            ).stdout
        ):
            pytest.skip("10.214.255.254 is this machine's own address")
        killed = sweep_driver_nodes()
        assert orphan.pid in killed and live.pid not in killed, killed
        assert orphan.wait(timeout=10) == -9
        assert live.poll() is None
    finally:
        for proc in (orphan, live):
            proc.kill()
            proc.wait()
