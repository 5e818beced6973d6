"""Networks of namespaces (planaria.testing.netns), the local scheduler's ``netns`` option and
the agent's address: the pieces the partition tests stand on, each checked for real.

Everything here that makes namespaces needs root and iproute2, and skips without them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from planaria.agent.address import gloo_interface, interface_of, node_address
from planaria.errors import SchedulerError
from planaria.process import proc_stat
from planaria.scheduler.api import LaunchSpec, NodeState
from planaria.scheduler.local import LocalOptions, LocalScheduler
from planaria.testing import SchedulerConformance
from planaria.testing.netns import NETNS_DIR, REGISTRY, Network, sweep_stale

MakeNetwork = Callable[..., Network]

# Inside a namespace: try to connect to ADDR:PORT for at most one second, say what happened.
PROBE = textwrap.dedent(
    """
    import socket, sys
    try:
        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()
        print("connected")
    except socket.timeout:
        print("timeout")
    except OSError as exc:
        print(type(exc).__name__)
    """
)


def probe(net: Network, source: str, target: str, port: int = 9) -> str:
    argv = net.exec(source, [sys.executable, "-c", PROBE, net.address(target), str(port)])
    return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()


def node_pid(net: Network, node_id: str, timeout: float = 10.0) -> int:
    """The process in ``net``'s namespaces that the local scheduler started as ``node_id``
    (the agent's own pid: ``ip netns exec`` became the command)."""
    wanted = f"PLANARIA_NODE_ID={node_id}".encode()
    deadline = time.monotonic() + timeout
    while True:
        for pid in net.pids():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if wanted in environ and not cmdline.startswith(b"ip\0"):
                return pid
        assert time.monotonic() < deadline, f"{node_id} is in none of the namespaces"
        time.sleep(0.01)


def netns_inode(name: str) -> int:
    return (NETNS_DIR / name).stat().st_ino


def process_netns(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


# -- the network ------------------------------------------------------------------------------


def test_participants_reach_each_other_until_cut_and_again_once_healed(
    network: MakeNetwork,
) -> None:
    net = network("a", "b", "c")
    for name in ("a", "b", "c"):
        assert net.netns(name) == f"pl-{net.tag}-{name}" and len(net.netns(name)) <= 15
    assert len({net.address(n) for n in ("a", "b", "c")}) == 3
    # Nothing listens on port 9: "refused" is the answer of a reachable peer's kernel.
    assert probe(net, "a", "b") == "ConnectionRefusedError"

    net.cut("b")
    assert net.is_cut("b") and not net.is_cut("a")
    # A silent cut: no refusal, no "unreachable", the packets just vanish, both ways.
    assert probe(net, "a", "b") == "timeout"
    assert probe(net, "b", "c") == "timeout"
    assert probe(net, "a", "c") == "ConnectionRefusedError"  # the others still talk
    net.heal("b")
    assert not net.is_cut("b")
    assert probe(net, "a", "b") == "ConnectionRefusedError"

    net.cut("b", how="down")
    assert net.is_cut("b")
    assert probe(net, "a", "b") != "ConnectionRefusedError"
    net.heal("b")
    assert probe(net, "b", "a") == "ConnectionRefusedError"
    with pytest.raises(ValueError, match="unknown cut 'slow'"):
        net.cut("a", how="slow")
    with pytest.raises(KeyError, match="no participant 'z' in this network: it has a, b, c"):
        net.address("z")


def test_a_network_that_joins_the_host_is_reached_from_it_and_leaves_no_link(
    network: MakeNetwork,
) -> None:
    """The machine itself on the bridge: a daemon here (a controller, a driver) and the nodes
    in their namespaces reach each other by routable addresses; the host's link goes with the
    network, and a cut of the host silences it both ways."""
    net = network("a", "b", host=True)
    assert net.host_address == f"10.214.{net.subnet}.254"
    assert net.address("host") == net.host_address and net.exec("host", ["true"]) == ["true"]
    assert probe(net, "a", "host") == "ConnectionRefusedError"
    assert probe(net, "host", "b") == "ConnectionRefusedError"
    route = subprocess.run(
        ["ip", "-4", "route", "get", net.address("a")], capture_output=True, text=True, check=True
    ).stdout
    assert f"dev {net.host_link} src {net.host_address}" in route
    # A second network never shares the first one's subnet: both are routes of this machine.
    other = network("c", host=True)
    assert other.subnet != net.subnet
    net.cut("host")
    assert probe(net, "host", "a") == "timeout" and probe(net, "b", "host") == "timeout"
    net.heal("host")
    assert probe(net, "b", "host") == "ConnectionRefusedError"
    link = net.host_link
    assert net.close() == []
    shown = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert f" {link}@" not in shown and f" {link}:" not in shown


def test_an_established_connection_stalls_through_a_cut_and_resumes(
    network: MakeNetwork,
) -> None:
    """What a partition does to a connection in flight: nothing is lost or reset, the bytes
    arrive once the cut heals."""
    net = network("server", "client")
    serve = textwrap.dedent(
        """
        import socket, sys
        server = socket.create_server((sys.argv[1], 7000))
        print("listening", flush=True)
        conn, _ = server.accept()
        while data := conn.recv(100):
            conn.sendall(data)
        """
    )
    server = subprocess.Popen(
        net.exec("server", [sys.executable, "-c", serve, net.address("server")]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline() == "listening\n"
        talk = textwrap.dedent(
            """
            import socket, sys, time
            conn = socket.create_connection((sys.argv[1], 7000), timeout=20)
            conn.sendall(b"one"); print(conn.recv(100).decode(), flush=True)
            input()  # the cut is made now
            conn.settimeout(0.5)
            conn.sendall(b"two")
            try:
                conn.recv(100)
                print("answered during the cut", flush=True)
            except socket.timeout:
                print("stalled", flush=True)
            input()  # healed
            conn.settimeout(20)
            started = time.monotonic()
            print(conn.recv(100).decode(), round(time.monotonic() - started, 1), flush=True)
            """
        )
        client = subprocess.Popen(
            net.exec("client", [sys.executable, "-c", talk, net.address("server")]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert client.stdin is not None and client.stdout is not None
        assert client.stdout.readline() == "one\n"
        net.cut("client")
        client.stdin.write("\n")
        client.stdin.flush()
        assert client.stdout.readline() == "stalled\n"
        net.heal("client")
        client.stdin.write("\n")
        client.stdin.flush()
        word, seconds = client.stdout.readline().split()
        assert word == "two" and float(seconds) < 10
        client.stdin.close()
        assert client.wait(timeout=10) == 0
        client.stdout.close()
    finally:
        server.kill()
        server.wait()
        if server.stdout is not None:
            server.stdout.close()


def test_teardown_kills_what_is_left_and_removes_every_namespace(network: MakeNetwork) -> None:
    net = Network(["x", "y"])
    net.create()
    names = [net.hub, net.netns("x"), net.netns("y")]
    assert all((NETNS_DIR / n).exists() for n in names)
    assert (REGISTRY / net.tag).exists()
    left = subprocess.Popen(net.exec("y", ["sleep", "60"]))
    deadline = time.monotonic() + 10
    while process_netns(left.pid) != netns_inode(net.netns("y")):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert net.pids("y") == [left.pid]
    assert net.close() == [left.pid]
    assert left.wait(timeout=5) == -signal.SIGKILL
    assert not any((NETNS_DIR / n).exists() for n in names)
    assert not (REGISTRY / net.tag).exists()
    assert net.close() == []  # twice is fine


def test_a_network_whose_creator_died_is_swept_by_the_next(network: MakeNetwork) -> None:
    make = textwrap.dedent(
        """
        import json
        from planaria.testing.netns import Network
        net = Network(["lone"])
        net.create()
        print(json.dumps([net.hub, net.netns("lone")]), flush=True)
        """
    )
    # The creator exits without its teardown, as a SIGKILLed test run would.
    made = subprocess.run(
        [sys.executable, "-c", make], capture_output=True, text=True, timeout=60, check=True
    )
    names = json.loads(made.stdout)
    assert all((NETNS_DIR / n).exists() for n in names)
    assert sorted(sweep_stale()) == sorted(names)
    assert not any((NETNS_DIR / n).exists() for n in names)
    # A live network is left alone.
    live = network("kept")
    sweep_stale()
    assert (NETNS_DIR / live.netns("kept")).exists()


def test_participant_names_must_fit_a_link_name() -> None:
    with pytest.raises(ValueError, match=r"'far-too-long-name'.*15 characters"):
        Network(["far-too-long-name"])
    with pytest.raises(ValueError, match="'No_Caps'"):
        Network(["No_Caps"])
    with pytest.raises(ValueError, match="not 'hub'"):
        Network(["hub"])
    with pytest.raises(ValueError, match="repeat"):
        Network(["a", "a"])
    with pytest.raises(ValueError, match="at least one"):
        Network([])


# -- the agent's address ------------------------------------------------------------------------


def test_the_agent_takes_the_address_of_its_route_to_the_master(network: MakeNetwork) -> None:
    net = network("master", "node")
    code = textwrap.dedent(
        """
        import json, sys
        from planaria.agent.address import gloo_interface, node_address
        addr = node_address(sys.argv[1])
        print(json.dumps([addr, gloo_interface(addr, {})]))
        """
    )
    argv = net.exec("node", [sys.executable, "-c", code, net.address("master")])
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout
    # Not what the host name resolves to: the address on the namespace's own link.
    assert json.loads(out) == [net.address("node"), {"GLOO_SOCKET_IFNAME": "eth0"}]


def test_node_address_without_namespaces() -> None:
    assert node_address("127.0.0.1") == "127.0.0.1"
    assert node_address("localhost") == "127.0.0.1"
    assert node_address("10.9.9.9", override="10.1.2.3") == "10.1.2.3"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("not an address") is None
    assert interface_of("192.0.2.77") is None  # TEST-NET-1: no interface holds it
    assert gloo_interface("127.0.0.1", {}) == {}  # every node on this machine: as before
    assert gloo_interface("10.1.2.3", {"GLOO_SOCKET_IFNAME": "ib0"}) == {}  # the user's wins
    # Some address of this machine off loopback, where it has one: its interface is found.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("192.0.2.1", 9))
            mine = sock.getsockname()[0]
    except OSError:
        return
    name = interface_of(mine)
    assert name is not None and name != "lo"
    assert gloo_interface(mine, {}) == {"GLOO_SOCKET_IFNAME": name}


# -- the local scheduler's netns option ---------------------------------------------------------


def test_nodes_run_in_their_namespaces_with_their_own_pid(
    network: MakeNetwork, tmp_path: Path
) -> None:
    net = network("n0", "n1")
    names = [net.netns("n0"), net.netns("n1")]
    scheduler = LocalScheduler(LocalOptions(netns=names, stop_grace=0.5))
    spec = LaunchSpec(job="t", command=(sys.executable, "-c", "import time; time.sleep(60)"))
    try:
        handles = scheduler.launch(spec, 3)
        for handle in handles:
            pid = node_pid(net, handle.node_id)
            assert b"time.sleep(60)" in Path(f"/proc/{pid}/cmdline").read_bytes()
            number = int(handle.node_id.rsplit("-", 1)[1])
            assert process_netns(pid) == netns_inode(names[number % 2])
            # ip netns exec execs the command: the node's process is the one started, a
            # direct child of the scheduler, its own process group's leader.
            assert os.getpgid(pid) == pid
            stat = proc_stat(pid)
            assert stat is not None and stat.ppid == os.getpid()
        # A replacement takes the next number, and so the next namespace.
        new = scheduler.replace("node-1", exclude_host=False)
        assert new.node_id == "node-3"
        assert process_netns(node_pid(net, "node-3")) == netns_inode(names[1])
    finally:
        scheduler.stop()
    assert net.pids() == []


def test_a_replaced_node_is_left_running_with_keep_replaced(network: MakeNetwork) -> None:
    net = network("n0")
    scheduler = LocalScheduler(
        LocalOptions(netns=[net.netns("n0")], keep_replaced=True, stop_grace=0.5)
    )
    spec = LaunchSpec(job="t", command=(sys.executable, "-c", "import time; time.sleep(60)"))
    try:
        scheduler.launch(spec, 1)
        old = node_pid(net, "node-0")
        scheduler.replace("node-0", exclude_host=False)
        time.sleep(0.5)
        assert old in net.pids("n0")  # like a partitioned machine: nobody stopped it
        events = scheduler.poll(0.2)
        assert [e.node_id for e in events] == ["node-1"]  # nothing more is heard of node-0
    finally:
        scheduler.stop()  # the job's end stops it too
    assert net.pids() == []


PARENT = """\
import sys
from planaria.scheduler.api import LaunchSpec
from planaria.scheduler.local import LocalOptions, LocalScheduler
scheduler = LocalScheduler(LocalOptions(netns=[sys.argv[1]]))
scheduler.launch(LaunchSpec(job="t", command=tuple(sys.argv[2:])), 1)
print("launched", flush=True)
sys.stdin.read()
"""


def test_nodes_in_namespaces_die_with_the_process_that_started_them(
    network: MakeNetwork,
) -> None:
    """The death signal set before ``ip netns exec`` survives its exec."""
    net = network("n0")
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, net.netns("n0"), "sleep", "60"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert parent.stdout is not None
        while parent.stdout.readline() not in ("launched\n", ""):  # past the log lines
            pass
        node_pid(net, "node-0")
        deadline = time.monotonic() + 10
        parent.kill()
        parent.wait()
        while net.pids("n0"):
            assert time.monotonic() < deadline, "the node outlived the process that started it"
            time.sleep(0.01)
    finally:
        parent.kill()
        parent.wait()
        for stream in (parent.stdin, parent.stdout):
            if stream is not None:
                stream.close()


def test_a_missing_namespace_is_a_clear_error(netns_available: None) -> None:
    scheduler = LocalScheduler(LocalOptions(netns=["pl-no-such-ns"]))
    spec = LaunchSpec(job="t", command=(sys.executable, "-c", "pass"))
    with pytest.raises(SchedulerError) as error:
        scheduler.launch(spec, 1)
    message = str(error.value)
    assert "no network namespace 'pl-no-such-ns'" in message
    assert "scheduler.options.netns" in message
    assert "ip netns add pl-no-such-ns" in message
    assert scheduler.poll(0.0) == []  # nothing started


def test_netns_option_validation() -> None:
    assert LocalOptions().netns == []
    assert LocalOptions.model_validate({"netns": ["pl-1-n0", "lab.b_2"]}).netns == [
        "pl-1-n0",
        "lab.b_2",
    ]
    for bad in ("../etc", "a/b", "", "..", "sp ace"):
        with pytest.raises(ValidationError, match="not a network namespace name"):
            LocalOptions.model_validate({"netns": [bad]})


class TestLocalSchedulerInNamespaces(SchedulerConformance):
    """Every node in a namespace of its own: the scheduler keeps all its promises."""

    @pytest.fixture
    def scheduler(self, network: MakeNetwork) -> LocalScheduler:
        net = network("n0", "n1")
        return LocalScheduler(
            LocalOptions(netns=[net.netns("n0"), net.netns("n1")], stop_grace=0.5)
        )


def test_states_seen_in_namespaces_are_those_of_plain_nodes(network: MakeNetwork) -> None:
    net = network("n0")
    scheduler = LocalScheduler(LocalOptions(netns=[net.netns("n0")]))
    spec = LaunchSpec(job="t", command=(sys.executable, "-c", "import sys; sys.exit(3)"))
    try:
        scheduler.launch(spec, 1)
        seen: list[tuple[NodeState, str]] = []
        deadline = time.monotonic() + 30
        while len(seen) < 2:
            assert time.monotonic() < deadline, seen
            seen += [(e.state, e.reason) for e in scheduler.poll(0.1)]
        assert seen == [(NodeState.RUNNING, ""), (NodeState.FAILED, "exit code 3")]
    finally:
        scheduler.stop()
