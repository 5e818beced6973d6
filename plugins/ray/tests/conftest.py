"""A real Ray cluster for the whole session: a head and three worker raylets on this machine
(distinct ports, 100 MiB object stores, no dashboard), all on loopback (every node's address
is 127.0.0.1, so that its processes listen there alone, and the driver joins 127.0.0.1), and
a check after every test that it left nothing behind.

The cluster's processes (GCS, raylets, their helpers) outlive every test on purpose: they are
started without the session's marker (:mod:`planaria.leftovers`). The agents' actors are Ray
workers that the raylets start; the scheduler passes the marker on to them in their runtime
environment, so an actor (and its agent, and the agent's workers) that a test leaves running
is found and fails it. The GCS declares a node dead after about two seconds of failed health
checks (15 s by default), so that a killed raylet is news within a test's patience.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from planaria import leftovers
from planaria.testing import assert_nothing_left
from planaria_ray.cluster import worker_ports

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

WORKERS = 3
NODE: dict[str, Any] = {
    "num_cpus": 2,
    "object_store_memory": 100 * 1024 * 1024,
    "node_ip_address": "127.0.0.1",
}
AGENT = {"agent": 1}
"""The worker raylets have it, the head not: the job tests' agents go on those three only (a
two-node job and one free node), and the head, whose GCS the driver needs, is never lost."""
HEALTH = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 4,
}


HOME = Path(tempfile.mkdtemp(prefix="planaria-ray-home-"))
"""The cluster's processes' home. Ray's head asks cloud metadata servers (169.254.169.254)
which cloud it runs on, usage reports off or not, unless its home holds a cluster launcher's
``ray_bootstrap_config.yaml``: an empty one keeps the session on loopback."""
(HOME / "ray_bootstrap_config.yaml").write_text("{}\n")


@contextlib.contextmanager
def unmarked() -> Iterator[None]:
    """os.environ without the session's marker, for what outlives the tests on purpose, with
    the cluster's home."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(leftovers.unmarked(saved), HOME=str(HOME))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session", autouse=True)
def trace_marker() -> Iterator[str]:
    with leftovers.marking() as marker:
        yield marker


@pytest.fixture(autouse=True)
def nothing_left_running(trace_marker: str) -> Iterator[None]:
    yield
    assert_nothing_left(trace_marker)


class RayCluster:
    """The session's cluster: its address, and ways to lose and add nodes."""

    def __init__(self) -> None:
        os.environ["RAY_AUTH_MODE"] = "disabled"
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no usage report
        self.started = 0
        with unmarked():
            self.cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    **NODE,
                    **self._ports(),
                    "include_dashboard": False,
                    "_system_config": HEALTH,
                },
            )
            for _ in range(WORKERS):
                self.cluster.add_node(**NODE, **self._ports(), resources=AGENT)
            self.cluster.wait_for_nodes()
        self.address: str = self.cluster.address

    def _ports(self) -> dict[str, int]:
        """Each node's own worker ports, away from the rendezvous' (see ``worker_ports``)."""
        self.started += 1
        return worker_ports(self.started - 1)

    def worker_nodes(self) -> list[Any]:
        return list(self.cluster.worker_nodes)

    def node_by_id(self, node_id: str) -> Any:
        for node in [self.cluster.head_node, *self.cluster.worker_nodes]:
            if node is not None and node.node_id == node_id:
                return node
        raise LookupError(f"no Ray node {node_id} in the session's cluster")

    def kill_raylet(self, node_id: str) -> int:
        """SIGKILL the raylet of the Ray node ``node_id`` from outside, as a dying machine
        would; the node's processes follow it. Returns the raylet's pid."""
        node = self.node_by_id(node_id)
        (raylet,) = node.all_processes["raylet"]
        os.kill(raylet.process.pid, signal.SIGKILL)
        raylet.process.wait()
        # The node's other daemons go as with the machine; the cluster forgets the node.
        self.cluster.remove_node(node, allow_graceful=False)
        return int(raylet.process.pid)

    def add_node(self) -> str:
        with unmarked():
            node = self.cluster.add_node(**NODE, **self._ports(), resources=AGENT)
            self.cluster.wait_for_nodes()
        return str(node.node_id)

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            ray.shutdown()
        self.cluster.shutdown()
        shutil.rmtree(HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    cluster = RayCluster()
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture
def ray_address(ray_cluster: RayCluster) -> str:
    return ray_cluster.address
