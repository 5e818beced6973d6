"""The batch host's address for the master's agents (``python -m planaria_slurm.address``),
and the batch script's use of it: in network namespaces of their own (a default route or
none), and in a real allocation, whose nodes are hosts of their own (conftest)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import conftest
import pytest
from planaria_slurm import SlurmOptions, SlurmScheduler
from planaria_slurm.address import batch_host_address

from planaria.master.advertise import ADVERTISE_ENV, Advertised
from planaria.plugin import SubmitRequest
from planaria.testing.jobs import job_events, run_planaria, wait_for, write_job
from planaria.testing.netns import Network, unavailable


@pytest.fixture
def net() -> Iterator[Network]:
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    with Network(["batch", "gw"]) as made:
        # The batch host's name maps to loopback in its namespace (``ip netns exec`` reads
        # /etc/netns/<name>/hosts as /etc/hosts): it cannot stand in for an address.
        etc = Path("/etc/netns") / made.netns("batch")
        etc.mkdir(parents=True)
        try:
            (etc / "hosts").write_text(f"127.0.0.1 localhost {socket.gethostname()}\n")
            yield made
        finally:
            (etc / "hosts").unlink()
            etc.rmdir()
        assert made.close() == []


def _in(net: Network, argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", ADVERTISE_ENV)}
    return subprocess.run(
        net.exec("batch", argv), capture_output=True, text=True, timeout=60, env=env
    )


def _script_part(tmp_path: Path) -> str:
    """The batch script up to its ``exec``, which then shows what ``planaria run`` would get."""
    request = SubmitRequest(
        config=tmp_path / "job.yaml",
        job="train",
        min_nodes=2,
        max_nodes=2,
        procs_per_node=1,
        workdir=tmp_path,
        directory=tmp_path,
        python=sys.executable,
    )
    script = SlurmScheduler.submit(SlurmOptions(), request, dry_run=True).script
    head, _, _ = script.partition("\nexec ")
    return f'{head}\nprintf "%s" "${{{ADVERTISE_ENV}-<unset>}}"\n'


def test_the_default_route_s_address_or_exit_2_and_the_script_passes_it_on(net, tmp_path):
    module = [sys.executable, "-m", "planaria_slurm.address"]
    done = _in(net, module)
    assert done.returncode == 2 and done.stdout == "", done
    assert "cannot tell this host's address" in done.stderr and "no default route" in done.stderr
    script = tmp_path / "batch.sh"
    script.write_text(_script_part(tmp_path))
    environ = {ADVERTISE_ENV: "stale"}  # sbatch passes the submitter's environment on
    shown = subprocess.run(
        net.exec("batch", ["env", *(f"{k}={v}" for k, v in environ.items()), "sh", str(script)]),
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert shown.stdout == "<unset>", shown  # planaria run chooses, or stops, itself
    subprocess.run(
        ["ip", "-n", net.netns("batch"), "route", "add", "default", "via", net.address("gw")],
        check=True,
    )
    done = _in(net, module)
    assert (done.returncode, done.stdout) == (0, f"{net.address('batch')}\n"), done
    assert "this machine's default route" in done.stderr
    shown = subprocess.run(
        net.exec("batch", ["sh", str(script)]), capture_output=True, text=True, timeout=60
    )
    assert shown.stdout == net.address("batch"), shown


def test_from_this_machine_the_nodes_are_reached_from_its_address_on_their_network(
    allocation, slurm_network
):
    """This machine is the cluster's login host: the allocation's nodes are at their
    NodeAddr, and this machine reaches them from its own address on their network."""
    scheduler = SlurmScheduler(SlurmOptions(job_id=allocation))
    nodes = [slurm_network.address(f"node{i}") for i in range(1, conftest.NODES + 1)]
    assert scheduler.node_addresses() == nodes
    assert batch_host_address({"SLURM_JOB_ID": allocation}) == Advertised(
        slurm_network.host_address, f"the address this machine reaches the nodes from ({nodes[0]})"
    )


def test_a_submitted_job_bound_to_every_interface_tells_its_agents_the_batch_host(
    tmp_path, slurm_cluster, slurm_network
):
    """``planaria submit`` of a job with ``master.host: 0.0.0.0`` and no advertise: the batch
    script finds the batch host's own address (a node, a host of its own), the master takes
    it, serves TLS, and both agents reach it."""
    command = [sys.executable, "-c", "from planaria import monitor; monitor.step(1)"]
    scheduler = {"backend": "slurm", "options": {"sbatch": ["--oversubscribe"]}}
    config = write_job(tmp_path, "advertise", command, scheduler)
    submitted = run_planaria(tmp_path, "submit", str(config), "--set", "master.host=0.0.0.0")
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = submitted.stdout.split()[-1]

    def ended() -> bool:
        return conftest.slurm("squeue", "-h", "-j", job_id, check=False).stdout.strip() == ""

    wait_for("the job's end", ended, timeout=180)
    shown = conftest.slurm("scontrol", "show", "job", job_id).stdout
    batch_host = re.search(r"BatchHost=(\S+)", shown)
    assert batch_host, shown
    address = slurm_network.address(batch_host[1])
    (out,) = tmp_path.glob(".planaria/slurm-*.out")
    output = " ".join(out.read_text().split())
    assert (
        f"this host's address for the allocation's nodes: {address} (the address this machine "
        "reaches the nodes from (" in output
    ), output
    assert (
        f"agents are told the master is at {address}: {ADVERTISE_ENV}, as the environment found "
        "it" in output
    ), output
    assert f"master at https://{address}:" in output, output
    finished = [e for e in job_events(tmp_path) if e["kind"] == "job_finished"]
    # Its two nodes trained: both agents reached the master at the address they were told.
    assert [e["data"]["state"] for e in finished] == ["succeeded"], output
