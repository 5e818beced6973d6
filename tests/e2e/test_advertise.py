"""The address agents are told for a master bound to every interface: chosen, never a
wildcard, and said (planaria.master.advertise).

The choice is tested where it is made: in network namespaces of their own (routes, a default
route or none), and end to end, with ``planaria run`` binding ``0.0.0.0`` over TLS in one
namespace and its nodes in two others, reaching it at the address it chose. Namespaces need
root (tests/support/netns.py); those tests are skipped without.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from planaria.master.advertise import (
    ADVERTISE_ENV,
    Advertised,
    AdvertiseError,
    Probes,
    carried_name,
    choose,
    is_wildcard,
    routable_name,
    toward_nodes,
    url_host,
)
from planaria.master.journal import Journal
from planaria.scheduler.local import LocalOptions, LocalScheduler
from planaria.testing.jobs import events, planaria_command
from planaria.testing.netns import Network


def _nothing() -> list[str]:
    raise AssertionError("the nodes were asked for though the choice was made already")


def test_wildcards_urls_and_names():
    assert [is_wildcard(h) for h in ("", "0.0.0.0", "::", "0:0::0")] == [True] * 4
    assert not any(is_wildcard(h) for h in ("127.0.0.1", "10.0.0.1", "::1", "node-3"))
    assert url_host("fd00::7") == "[fd00::7]"
    assert url_host("10.1.2.3") == "10.1.2.3" and url_host("login-1.hpc") == "login-1.hpc"
    assert all(carried_name(n) for n in ("10.0.0.1", "fd00::1", "n1", "login-1.hpc.example."))
    assert not any(carried_name(n) for n in ("", "a b", "-x", "a_b", "x:1", "$(id)", "é.example"))
    assert routable_name("localhost") is None  # loopback: no use to another machine
    assert routable_name("no such host.invalid") is None


def test_a_configured_address_is_kept_and_nothing_is_asked():
    assert choose("0.0.0.0", "login-1", env={}, nodes=_nothing) == Advertised(
        "login-1", "master.advertise"
    )
    assert choose("10.0.0.7", None, env={ADVERTISE_ENV: "10.9.9.9"}, nodes=_nothing) == Advertised(
        "10.0.0.7", "master.host"
    )


def test_the_environment_s_address_comes_first_and_a_bad_one_is_refused_naming_it():
    chosen = choose("0.0.0.0", None, env={ADVERTISE_ENV: " 10.1.0.4\n"}, nodes=_nothing)
    assert chosen.address == "10.1.0.4" and ADVERTISE_ENV in chosen.why
    with pytest.raises(AdvertiseError, match=rf"{ADVERTISE_ENV}='\$\(id\)' is neither"):
        choose("::", None, env={ADVERTISE_ENV: "$(id)"}, nodes=_nothing)


def test_nodes_on_this_machine_are_told_loopback():
    """The local scheduler's nodes run here: 127.0.0.1, through the real route lookup, on a
    machine with a default route or without one."""
    scheduler = LocalScheduler(LocalOptions())
    chosen = choose("0.0.0.0", None, env={}, nodes=scheduler.node_addresses)
    assert chosen == Advertised("127.0.0.1", "the nodes run on this machine (127.0.0.1)")


def test_what_comes_after_the_nodes_and_the_error_when_nothing_is_found():
    def probes(route: str | None, name: str | None) -> Probes:
        return Probes(
            toward_nodes=lambda hosts: toward_nodes(hosts, _unreachable),
            default_route=lambda: route,
            hostname=lambda: "trainer-7",
            routable_name=lambda n: name,
        )

    def _unreachable(host: str) -> str:
        raise OSError(101, "Network is unreachable")

    nodes = lambda: ["gpu-1", "gpu-2"]  # noqa: E731
    chosen = choose("0.0.0.0", None, env={}, nodes=nodes, probes=probes("10.3.0.2", None))
    assert chosen == Advertised("10.3.0.2", "the address of this machine's default route")
    chosen = choose("", None, env={}, nodes=nodes, probes=probes(None, "trainer-7"))
    assert chosen.address == "trainer-7" and "name" in chosen.why
    with pytest.raises(AdvertiseError) as refused:
        choose("0.0.0.0", None, env={}, nodes=nodes, probes=probes(None, None))
    message = str(refused.value)
    assert message.startswith("master.host is '0.0.0.0' (every interface)")
    assert "no route to the nodes' machines (gpu-1, gpu-2)" in message
    assert "no default route" in message and "'trainer-7'" in message
    assert message.endswith("Set master.advertise to the address or name of this machine that "
                            "the nodes reach")  # fmt: skip
    with pytest.raises(AdvertiseError, match="does not know the nodes' machines"):
        choose("::", None, env={}, nodes=list, probes=probes(None, None))


def test_a_node_name_of_this_machine_does_not_hide_the_others():
    """Slurm's allocation holds the batch host itself, whose name may map to loopback: the
    address comes from a node that is elsewhere."""
    sources = {"batch": "127.0.0.1", "gpu-2": "10.4.0.9"}
    chosen = toward_nodes(["batch", "gpu-2"], sources.__getitem__)
    assert chosen == Advertised("10.4.0.9", "the address this machine reaches the nodes from "
                                "(gpu-2)")  # fmt: skip
    assert toward_nodes(["batch"], sources.__getitem__) == Advertised(
        "127.0.0.1", "the nodes run on this machine (batch)"
    )


# --------------------------------------------------------------------- in network namespaces

PROBE = """
import json, sys
from planaria.master.advertise import default_route_address, toward_nodes
toward = toward_nodes(sys.argv[1:])
print(json.dumps({"default": default_route_address(), "toward": toward and toward.__dict__}))
"""


def _probe(net: Network, name: str, *nodes: str) -> dict:
    done = subprocess.run(
        net.exec(name, [sys.executable, "-c", PROBE, *nodes]),
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(done.stdout)


def test_the_route_to_the_nodes_and_the_default_route_in_namespaces(network):
    net = network("m", "a", "b")
    master, a = net.address("m"), net.address("a")
    seen = _probe(net, "m", a, "10.215.0.1")
    assert seen == {
        "default": None,  # a namespace's one route is its own /24
        "toward": {"address": master, "why": f"the address this machine reaches the nodes from "
                                             f"({a})"},
    }  # fmt: skip
    assert _probe(net, "m", "10.215.0.1")["toward"] is None  # no route there
    subprocess.run(["ip", "-n", net.netns("m"), "route", "add", "default", "via", a], check=True)
    assert _probe(net, "m")["default"] == master
    subprocess.run(
        ["ip", "-n", net.netns("b"), "route", "add", "default", "dev", "eth0"], check=True
    )
    assert _probe(net, "b")["default"] == net.address("b")  # no gateway: the interface's own


def test_the_local_scheduler_knows_its_namespaces_addresses(network):
    net = network("m", "n0", "n1")
    options = LocalOptions(netns=[net.netns("n0"), net.netns("n1")])
    assert LocalScheduler(options).node_addresses() == [net.address("n0"), net.address("n1")]
    subprocess.run(["ip", "-n", net.netns("n1"), "addr", "flush", "dev", "eth0"], check=True)
    assert LocalScheduler(options).node_addresses() == [net.address("n0")]


# --------------------------------------------------------------------------------- end to end

WORKER = """
import json, os, sys
from pathlib import Path

def environ(pid):
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(e.split("=", 1) for e in raw.decode(errors="replace").split("\\0") if "=" in e)

seen = []
for entry in Path("/proc").iterdir():
    try:
        cmd = (entry / "cmdline").read_bytes().split(b"\\0")
        env = environ(entry.name) if cmd[1:4] == [b"-m", b"planaria", b"agent"] else {}
    except OSError:
        continue
    if env.get("PLANARIA_TEST_MARK") == os.environ["PLANARIA_TEST_MARK"]:
        seen.append(env["PLANARIA_MASTER"])
out = Path(sys.argv[1]) / f"rank-{os.environ['RANK']}.json"
out.write_text(json.dumps({"agents": seen, "master_addr": os.environ["MASTER_ADDR"]}))
"""


def _job(tmp_path: Path, net: Network) -> Path:
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(WORKER))
    config = {
        "job": {
            "name": "advertise",
            "command": [sys.executable, str(worker), str(tmp_path)],
            "nodes": 2,
            "procs_per_node": 1,
            "max_restarts": 0,
            "preload": [],
        },
        "scheduler": {
            "backend": "local",
            "options": {"netns": [net.netns("n0"), net.netns("n1")]},
        },
        "rendezvous": {"join_grace": "500ms", "join_timeout": "60s"},
        # Bound to every interface, advertising nothing; TLS, as off loopback by default.
        "master": {"host": "0.0.0.0", "heartbeat_interval": "1s", "heartbeat_timeout": "60s"},
        "diagnosis": {"checks": []},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _run(tmp_path: Path, mark: str, net: Network) -> subprocess.CompletedProcess[str]:
    argv, env = planaria_command(mark, (str(_job(tmp_path, net)),))
    env.pop(ADVERTISE_ENV, None)
    return subprocess.run(
        net.exec("master", argv), cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip


def test_agents_in_other_namespaces_reach_a_master_bound_to_every_interface(
    tmp_path: Path, mark: str, network: Callable[..., Network]
):
    net = network("master", "n0", "n1")
    address = net.address("master")
    result = _run(tmp_path, mark, net)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    flat = " ".join(result.stdout.split())
    assert (
        f"agents are told the master is at {address}: the address this machine reaches the "
        f"nodes from ({net.address('n0')})" in flat
    ), output
    assert f"master at https://{address}:" in flat and "0.0.0.0:" not in flat, output
    told = set()
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert len(seen["agents"]) == 2, seen
        assert all(url.startswith(f"https://{address}:") for url in seen["agents"]), seen
        told.add(seen["master_addr"])
    # torch.distributed's store is on rank 0's node, at its address in its namespace.
    assert len(told) == 1 and told <= {net.address("n0"), net.address("n1")}, told
    (cert,) = tmp_path.glob("planaria-runs/*/tls/cert.pem")
    names = (
        x509.load_pem_x509_certificate(cert.read_bytes())
        .extensions.get_extension_for_class(x509.SubjectAlternativeName)
        .value
    )
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address(address)]
    (finished,) = [e for e in events(tmp_path) if e["kind"] == "job_finished"]
    assert finished["data"]["state"] == "succeeded", finished
    (run_dir,) = tmp_path.glob("planaria-runs/*")
    server = Journal.read(run_dir).meta["server"]
    assert server["advertise"] == address and server["host"] == "0.0.0.0"


def test_a_master_that_cannot_tell_its_address_stops_naming_master_advertise(
    tmp_path: Path, mark: str, network: Callable[..., Network]
):
    """No node address to route to (n0 and n1 have none), no default route, and this
    machine's name mapped to loopback in the master's namespace (``ip netns exec`` reads
    ``/etc/netns/<name>/hosts`` as ``/etc/hosts``): exit 2, nothing started or left."""
    net = network("master", "n0", "n1")
    for node in ("n0", "n1"):
        subprocess.run(["ip", "-n", net.netns(node), "addr", "flush", "dev", "eth0"], check=True)
    etc = Path("/etc/netns") / net.netns("master")
    etc.mkdir(parents=True)
    try:
        (etc / "hosts").write_text(f"127.0.0.1 localhost {socket.gethostname()}\n")
        result = _run(tmp_path, mark, net)
    finally:
        (etc / "hosts").unlink()
        etc.rmdir()
    assert result.returncode == 2, result.stdout + result.stderr
    message = " ".join(result.stderr.split())
    assert "master.advertise" in message and "no default route" in message, message
    assert "Set master.advertise to the address or name of this machine" in message, message
    assert "master at" not in result.stdout
    assert list(tmp_path.glob("planaria-runs/*")) == []
    assert not os.path.exists(tmp_path / "rank-0.json")


STEPPER = """
import sys, time
from pathlib import Path
from planaria import monitor
for step in range(1, 31):
    monitor.step(step)
    Path(sys.argv[1]).write_text(str(step))
    time.sleep(0.25)
"""


def _step(progress: Path) -> int:
    try:
        return int(progress.read_text() or 0)
    except (OSError, ValueError):
        return 0


def test_a_resumed_master_keeps_the_address_its_agents_were_told(tmp_path: Path, mark: str):
    """The first master took its address from the environment; the one resumed on its run
    directory, in an environment that says otherwise, keeps it (the agents know no other)."""
    stepper, progress = tmp_path / "stepper.py", tmp_path / "progress"
    stepper.write_text(STEPPER)
    config = tmp_path / "job.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "job": {
                    "name": "resume",
                    "command": [sys.executable, str(stepper), str(progress)],
                    "nodes": 1,
                    "procs_per_node": 1,
                    "max_restarts": 0,
                    "preload": [],
                },
                "rendezvous": {"join_grace": "500ms", "join_timeout": "60s"},
                "master": {"host": "0.0.0.0", "heartbeat_interval": "0.5s", "grace": "60s"},
                "diagnosis": {"checks": []},
            }
        )
    )
    argv, env = planaria_command(mark, (str(config),))
    first = subprocess.Popen(
        argv, cwd=tmp_path, env={**env, ADVERTISE_ENV: "127.0.0.1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while _step(progress) < 3:
            assert time.monotonic() < deadline and first.poll() is None, "no step 3"
            time.sleep(0.1)
    finally:
        first.kill()
        said = first.communicate(timeout=30)[0]
    assert f"agents are told the master is at 127.0.0.1: {ADVERTISE_ENV}" in said, said
    (run_dir,) = tmp_path.glob("planaria-runs/*")
    argv, env = planaria_command(mark, ("--resume", str(run_dir)))
    resumed = subprocess.run(
        argv, cwd=tmp_path, env={**env, ADVERTISE_ENV: "localhost"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output
    flat = " ".join(resumed.stdout.split())
    assert (
        "agents are told the master is at 127.0.0.1: as the job's first master told its agents"
        in flat
    ), output
    assert "master at https://127.0.0.1:" in flat, output
    assert progress.read_text() == "30"
