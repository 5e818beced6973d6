"""A training job over Slurm nodes that are hosts of their own (conftest: each slurmd in a
network namespace with its own address), as on a real cluster: ``planaria submit`` of
examples/train_gpt.py on 2 nodes and a spare, the master bound to every interface with no
``master.advertise`` and TLS on (the default off loopback). The master finds the address the
nodes reach it at by itself; one node's step is cancelled from outside (``scancel``), a
replacement comes up on the third host, and the job ends with bitwise the weights of a run
without a fault. Nothing of the job can have gone through loopback: a node reaches no other on
``127.0.0.1``."""

from __future__ import annotations

import ipaddress
import re
import time
from pathlib import Path

import pytest
from conftest import slurm
from slurm_jobs import finish, submit_and_pause

from planaria.master.journal import Journal
from planaria.process import proc_stat
from planaria.testing.jobs import final_weights, job_events, wait_for
from planaria.testing.netns import Network

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("slurm_cluster")

AGENT = ["-m", "planaria", "agent"]


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _parent(pid: int) -> int:
    stat = proc_stat(pid)
    return -1 if stat is None else stat.ppid


def agent_pid(net: Network, node: str) -> int:
    """The pid of the one planaria agent running in Slurm node ``node``'s namespace (not a
    child it forked, which shows the same command line)."""
    candidates = {pid for pid in net.pids(node) if _cmdline(pid)[1:4] == AGENT}
    found = [pid for pid in candidates if _parent(pid) not in candidates]
    assert len(found) == 1, f"agents in {node}'s namespace: {found}"
    return found[0]


def test_a_job_over_hosts_of_their_own_loses_one_and_ends_as_without_the_fault(
    tmp_path, slurm_network, clean_weights
):
    net = slurm_network
    subnet = ipaddress.ip_network(f"{net.host_address}/24", strict=False)
    job_id, agents = submit_and_pause(tmp_path)
    assert len(agents) == 2, agents
    hosts = {name.rsplit(".", 1)[1]: host for name, (_, host) in agents.items()}
    assert hosts["node-0"] != hosts["node-1"], hosts
    allocated = slurm("squeue", "-h", "-j", job_id, "-o", "%N").stdout.strip()
    nodes = slurm("scontrol", "show", "hostnames", allocated).stdout.split()
    (spare,) = [n for n in nodes if n not in hosts.values()]
    batch_host = slurm("squeue", "-h", "-j", job_id, "-o", "%B").stdout.strip()
    assert batch_host in nodes, batch_host
    # Each agent runs on its host, in that host's network namespace; the spare has none.
    for host in hosts.values():
        agent_pid(net, host)
    assert not [p for p in net.pids(spare) if _cmdline(p)[1:4] == AGENT]

    step_id, _ = next(step for name, step in agents.items() if name.endswith(".node-1"))
    cancelled = time.monotonic()
    slurm("scancel", step_id)

    def replaced() -> dict | None:
        return next((e for e in job_events(tmp_path) if e["kind"] == "node_replaced"), None)

    event = wait_for("the replacement", replaced)
    took = time.monotonic() - cancelled
    assert event["message"].endswith(f"on {spare}"), event
    output = finish(tmp_path, job_id)
    assert "succeeded" in output, output
    print(f"scancel -> node_replaced in {took:.1f}s")

    # The master, on the batch host, found that host's own address and told the agents.
    master = net.address(batch_host)
    flat = " ".join(output.split())
    assert f"this host's address for the allocation's nodes: {master} " in flat, flat
    assert f"agents are told the master is at {master}:" in flat, flat
    assert re.search(rf"master at https://{re.escape(master)}:\d+", flat), flat
    # Each agent registered from the address its route to the master leaves from: its own
    # host's (127.0.0.1 had it reached the master on loopback), a distinct one per node.
    (run_dir,) = tmp_path.glob("planaria-runs/*")
    registered = {
        node_id: (record["host"], record["addr"])
        for node_id, record in Journal.read(run_dir).nodes.items()
    }
    assert len(registered) == 3, registered  # node-0, node-1 and node-1's replacement
    for node_id, (host, addr) in registered.items():
        assert addr == net.address(host), (node_id, host, addr)
        assert ipaddress.ip_address(addr) in subnet, (node_id, addr)
    assert sorted(host for host, _ in registered.values()) == sorted([*hosts.values(), spare])
    assert len({addr for _, addr in registered.values()}) == 3, registered

    restored = [e for e in job_events(tmp_path) if e["kind"] == "rendezvous_completed"]
    assert restored[-1]["data"]["restore"] == "storage", restored[-1]
    final = final_weights(tmp_path)
    assert final.keys() == clean_weights.keys()
    assert all(torch.equal(final[k], clean_weights[k]) for k in final)
