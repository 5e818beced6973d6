"""A real Ray cluster on this machine whose every node is a host of its own, for the plugin's
tests and benchmarks: a head and worker raylets, each started by ``ray start`` inside a network
namespace of its own (:class:`planaria.testing.netns.Network`), at that namespace's address
``10.214.<k>.<n>``, so that no node is reachable as 127.0.0.1 and every connection between two
nodes, or between a node and this machine, crosses a bridge as between machines.

This machine joins the bridge too (``Network(..., host=True)``, at ``10.214.<k>.254``): the
tests' driver and the planaria master run here and reach the nodes by routable addresses, and
the nodes reach them back there. A Ray driver must attach to a raylet of its own machine (its
core worker registers that raylet's address as its own, and the nodes call the driver back
there), so this machine is a Ray node too: the *driver node*, a raylet at the host address with
no CPUs and no agent resource, on which nothing is ever placed, the way a login host joins a
cluster to submit to it. The driver finds it by its address (:func:`planaria_ray.cluster.join`).

Each node's namespace has its own ports, so every node uses Ray's default ones (GCS at 6379 on
the head); only the driver node, in this machine's namespace, takes free ports. The namespaces
share the filesystem (Ray's session directory, its sockets, /dev/shm) and the process ids, so
/proc shows every actor's processes.

Losing a node is losing its machine: its raylet is SIGKILLed, then every process left in its
namespace (:meth:`LocalCluster.kill_raylet`). A node added later (:meth:`LocalCluster.add_node`)
starts in a spare namespace, at an address no node had before, while there are spares (then in
the namespace of a node lost earlier, as a machine rebooted).

The cluster's processes outlive every test on purpose: they are started without the session's
marker (:mod:`planaria.leftovers`). The agents' actors are Ray workers that the raylets start;
the scheduler passes the marker on to them in their runtime environment, so an actor (and its
agent, and the agent's workers) that a test leaves running is found. The GCS declares a node
dead after about two seconds of failed health checks (15 s by default), so that a killed raylet
is news within a test's patience.

Ray's head asks cloud metadata servers (169.254.169.254) which cloud it runs on, usage reports
off or not, unless its home holds a cluster launcher's ``ray_bootstrap_config.yaml``: the
cluster's processes get a home of their own with an empty one. The cluster's temporary
directory is its own too (``--temp-dir``), so that ``ray start --head`` leaves no
``/tmp/ray/ray_current_cluster`` for another cluster's ``address: auto`` to find.

A worker raylet can carry Ray node labels (``ray start --labels``), by the name of its namespace
(``n1``, ``n2``...: ``labels={"n1": {"switch": "s1"}}``), as a machine's operator labels it
with where it stands in the network; a node added later in a namespace gets that namespace's.

Creating namespaces needs root: :func:`unavailable` says why a machine cannot (tests skip).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planaria import leftovers
from planaria.testing import netns
from planaria_ray.cluster import import_ray, join, worker_ports
from planaria_ray.options import RayOptions

HEAD = "head"
GCS_PORT = 6379
NODE: dict[str, Any] = {"num_cpus": 2, "object_store_memory": 100 * 1024 * 1024}
DRIVER_NODE: dict[str, Any] = {"num_cpus": 0, "object_store_memory": 80 * 1024 * 1024}
"""The driver node's: Ray's minimum object store, and nothing to place an actor on."""
AGENT = {"agent": 1}
"""The worker raylets have it, the head and the driver node not: agents that ask for it go on
those only, and the head, whose GCS the driver needs, is never lost."""
HEALTH = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 4,
}
START_TIMEOUT = 120.0
ATTEMPTS = 3
"""``ray start`` of a node that failed is tried again: its raylet gives up when the node's
dashboard agent has not written its ports within some 15 s (a fixed limit), which a loaded
machine's agent (seconds of Python imports) can take."""
PORTS = {
    "node-manager-port": 6380,
    "object-manager-port": 6381,
    "metrics-export-port": 6382,
    "dashboard-agent-listen-port": 6383,
    "dashboard-agent-grpc-port": 6384,
    "runtime-env-agent-port": 6385,
}
"""A node's ports, the same on every node (each has its namespace's ports to itself), so that
what listens where is known (``ss -ltn`` in a node's namespace)."""


def unavailable() -> str | None:
    """Why this machine cannot run the cluster (namespaces need root), or None."""
    return netns.unavailable()


@dataclass
class RayNode:
    """A worker raylet: the namespace it runs in, its address, its Ray node id, its labels."""

    name: str
    address: str
    node_id: str
    labels: dict[str, str] = field(default_factory=dict)


class LocalCluster:
    """A head and ``workers`` raylets with :data:`AGENT`, each a host of its own (see the
    module docstring); ways to lose and add nodes. ``spares``: namespaces kept for nodes added
    later; ``labels``: the Ray node labels of the raylets, by namespace name (``n1``...,
    ``n<workers + spares>``)."""

    def __init__(
        self,
        workers: int = 3,
        spares: int = 3,
        labels: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        names = [f"n{i}" for i in range(1, workers + spares + 1)]
        self.labels = {name: dict(found) for name, found in (labels or {}).items()}
        unknown = sorted(set(self.labels) - set(names))
        if unknown:
            raise ValueError(
                f"labels for {', '.join(unknown)}: no such namespace (they are n1 to n{len(names)})"
            )
        os.environ["RAY_AUTH_MODE"] = "disabled"
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        self.home = Path(tempfile.mkdtemp(prefix="planaria-ray-home-"))
        (self.home / "ray_bootstrap_config.yaml").write_text("{}\n")
        # Short: the session's unix sockets live under it (108 bytes at most).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="plray-"))
        self.ray = str(Path(sys.executable).with_name("ray"))
        self.started = 0
        self.nodes: dict[str, RayNode] = {}
        """The live worker raylets, by namespace name."""
        self.free = list(names)
        """Namespaces that hold no node: spares first, then those of nodes lost."""
        self.network = netns.Network([HEAD, *names], host=True)
        self.driver_group: int | None = None
        self.network.create()  # which removes the networks of runs killed before their end
        sweep_driver_nodes()
        try:
            self.host_address = self.network.host_address
            self.head_address = self.network.address(HEAD)
            self.address = f"{self.head_address}:{GCS_PORT}"
            self._start(HEAD, ["--head", f"--port={GCS_PORT}", "--include-dashboard=false",
                               f"--temp-dir={self.temp_dir}",
                               f"--system-config={json.dumps(HEALTH)}"], NODE)  # fmt: skip
            # One after the other: nodes starting at once take the same names for their
            # sockets and logs in the session directory they share.
            for _ in range(workers):
                self._start_worker()
            self.driver_group = self._start_driver_node()
        except BaseException:
            self.shutdown()
            raise

    # -- starting nodes -------------------------------------------------------------------

    def _environment(self) -> dict[str, str]:
        """This process's environment without any run's marker (what outlives the runs on
        purpose), with the cluster's home."""
        return {**leftovers.unmarked(dict(os.environ)), "HOME": str(self.home)}

    def _argv(self, address: str, extra: list[str], node: dict[str, Any]) -> list[str]:
        self.started += 1
        ports = worker_ports(self.started - 1)
        return [
            self.ray, "start", f"--node-ip-address={address}",
            f"--num-cpus={node['num_cpus']}",
            f"--object-store-memory={node['object_store_memory']}",
            f"--min-worker-port={ports['min_worker_port']}",
            f"--max-worker-port={ports['max_worker_port']}",
            "--disable-usage-stats", *extra,
        ]  # fmt: skip

    def _popen(self, argv: list[str]) -> subprocess.Popen[str]:
        """``ray start`` in a session of its own: the node's daemons stay in its process
        group (Ray starts none in a new one), by which the driver node's are killed."""
        return subprocess.Popen(
            argv,
            env=self._environment(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def _start(self, name: str, extra: list[str], node: dict[str, Any]) -> None:
        """``ray start`` in ``name``'s namespace; again, on a clean machine, when it failed
        (see :data:`ATTEMPTS`)."""
        extra = [*extra, *(f"--{option}={port}" for option, port in PORTS.items())]
        argv = self._argv(self.network.address(name), extra, node)
        for attempt in range(1, ATTEMPTS + 1):
            try:
                self._wait(name, self._popen(self.network.exec(name, argv)))
                return
            except RuntimeError:
                netns.kill_processes(self.network.netns(name))
                if attempt == ATTEMPTS:
                    raise

    def _wait(self, name: str, start: subprocess.Popen[str]) -> None:
        try:
            output, _ = start.communicate(timeout=START_TIMEOUT)
        except subprocess.TimeoutExpired:
            start.kill()
            output, _ = start.communicate()
        if start.returncode != 0:
            raise RuntimeError(
                f"`ray start` of Ray node {name} failed (exit {start.returncode}):\n"
                + output[-3000:]
            )

    def _start_worker(self) -> RayNode:
        if not self.free:
            raise RuntimeError("no namespace is free for another Ray node: make more spares")
        name = self.free.pop(0)
        labels = self.labels.get(name, {})
        extra = [f"--address={self.address}", f"--resources={json.dumps(AGENT)}"]
        if labels:
            extra.append("--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()))
        self._start(name, extra, NODE)
        address, node_id = self.network.address(name), self._node_id(name)
        node = self.nodes[name] = RayNode(name, address, node_id, dict(labels))
        return node

    def _start_driver_node(self) -> int:
        """The driver node, at the host address, on free ports of this machine's namespace;
        its process group."""
        extra = [f"--address={self.address}"]
        for option in PORTS:
            extra.append(f"--{option}={_free_port(self.host_address)}")
        argv = self._argv(self.host_address, extra, DRIVER_NODE)
        for attempt in range(1, ATTEMPTS + 1):
            start = self._popen(argv)
            try:
                self._wait("driver", start)
                return start.pid
            except RuntimeError:
                _kill_group(start.pid)
                if attempt == ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    def _raylet(self, name: str) -> int:
        """The pid of the raylet in ``name``'s namespace."""
        deadline = time.monotonic() + 30
        while True:
            for pid in self.network.pids(name):
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{pid}/comm").read_text().strip() == "raylet":
                        return pid
            if time.monotonic() > deadline:
                raise RuntimeError(f"no raylet runs in the namespace of Ray node {name}")
            time.sleep(0.1)

    def _node_id(self, name: str) -> str:
        argv = Path(f"/proc/{self._raylet(name)}/cmdline").read_bytes().split(b"\0")
        for arg in argv:
            if arg.startswith(b"--node_id="):
                return arg.split(b"=", 1)[1].decode()
        raise RuntimeError(f"the raylet of Ray node {name} has no --node_id")

    # -- the tests' ways --------------------------------------------------------------------

    def worker_nodes(self) -> list[RayNode]:
        return list(self.nodes.values())

    def node_by_id(self, node_id: str) -> RayNode:
        for node in self.nodes.values():
            if node.node_id == node_id:
                return node
        raise LookupError(f"no live worker Ray node {node_id} in this cluster")

    def kill_raylet(self, node_id: str) -> int:
        """SIGKILL the raylet of the Ray node ``node_id`` from outside, as a dying machine
        would, then every process left on that machine (its namespace), and remove the files
        in /dev/shm they held (the namespaces share this machine's; a dead machine's memory is
        gone with it). Returns the raylet's pid."""
        node = self.node_by_id(node_id)
        raylet = self._raylet(node.name)
        memory = _shared_memory(self.network.pids(node.name))
        os.kill(raylet, signal.SIGKILL)
        netns.kill_processes(self.network.netns(node.name))
        for path in memory:  # the machine's memory goes with it
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        del self.nodes[node.name]
        self.free.append(node.name)
        return raylet

    def add_node(self) -> str:
        """A new worker raylet on a host that holds none; its Ray node id."""
        return self._start_worker().node_id

    def ray_node_of(self, run_dir: Path, node_id: str) -> str:
        """The Ray node the actor of ``node_id`` of the run in ``run_dir`` runs on, asked of
        the actor itself."""
        ray = import_ray()
        join(RayOptions(address=self.address))  # as the driver does: from the driver node
        actor = ray.get_actor(f"planaria.{run_dir.name}.{node_id}", namespace="planaria")
        return str(ray.get(actor.ready.remote(), timeout=30)["ray_node"])

    def shutdown(self) -> None:
        """Every process of the cluster killed, its namespaces and links gone, its
        directories removed."""
        with contextlib.suppress(Exception):
            import_ray().shutdown()
        if self.driver_group is not None:
            _kill_group(self.driver_group)
            self.driver_group = None
        self.network.close()
        shutil.rmtree(self.home, ignore_errors=True)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


SHM = Path("/dev/shm")
_DRIVER_NODE = re.compile(
    rf"--node[-_]ip[-_]address=({re.escape(netns.SUBNET)}\.\d+\.{netns.HOST_NUMBER})$".encode()
)


def sweep_driver_nodes() -> list[int]:
    """SIGKILL the processes of driver nodes whose network is gone (a test run killed before
    its teardown): they run in this machine's namespace, out of the network's sweep, at a
    host address of a network no interface here holds any more. The pids killed."""
    local = set(re.findall(r"inet (\S+)/", subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=False
    ).stdout))  # fmt: skip
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            for arg in (entry / "cmdline").read_bytes().split(b"\0"):
                found = _DRIVER_NODE.match(arg)
                if found and found.group(1).decode() not in local:
                    os.kill(int(entry.name), signal.SIGKILL)
                    killed.append(int(entry.name))
                    break
    return killed


def _shared_memory(pids: list[int]) -> set[Path]:
    """The entries of /dev/shm (files, or a node's folder of them) that ``pids`` have open or
    mapped something in."""
    held: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                held.update(line.split(maxsplit=5)[5:])
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    held.add(os.readlink(fd))
    found = set()
    for path in held:
        if path.startswith(f"{SHM}/") and not path.endswith(" (deleted)"):
            found.add(SHM / Path(path).relative_to(SHM).parts[0])
    return found


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def _kill_group(group: int, wait: float = 10.0) -> None:
    """SIGKILL process group ``group`` until none of it is left."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.05)
