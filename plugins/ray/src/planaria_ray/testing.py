"""A real Ray cluster on this machine, on loopback, for the plugin's tests and benchmarks: a
head and worker raylets (distinct ports, 100 MiB object stores, no dashboard), every node at
127.0.0.1 so that its processes listen there alone.

The cluster's processes outlive every test on purpose: they are started without the
session's marker (:mod:`planaria.leftovers`). The agents' actors are Ray workers that the
raylets start; the scheduler passes the marker on to them in their runtime environment, so an
actor (and its agent, and the agent's workers) that a test leaves running is found. The GCS
declares a node dead after about two seconds of failed health checks (15 s by default), so
that a killed raylet is news within a test's patience.

Ray's head asks cloud metadata servers (169.254.169.254) which cloud it runs on, usage reports
off or not, unless its home holds a cluster launcher's ``ray_bootstrap_config.yaml``: the
cluster's processes get a home of their own with an empty one.
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

from planaria import leftovers
from planaria_ray.cluster import LOOPBACK, import_ray, join, worker_ports
from planaria_ray.options import RayOptions

NODE: dict[str, Any] = {
    "num_cpus": 2,
    "object_store_memory": 100 * 1024 * 1024,
    "node_ip_address": LOOPBACK,
}
AGENT = {"agent": 1}
"""The worker raylets have it, the head not: agents that ask for it go on those only, and the
head, whose GCS the driver needs, is never lost."""
HEALTH = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 4,
}


class LocalCluster:
    """A head and ``workers`` raylets with :data:`AGENT`; ways to lose and add nodes."""

    def __init__(self, workers: int = 3) -> None:
        os.environ["RAY_AUTH_MODE"] = "disabled"
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        self.home = Path(tempfile.mkdtemp(prefix="planaria-ray-home-"))
        (self.home / "ray_bootstrap_config.yaml").write_text("{}\n")
        self.started = 0
        from ray.cluster_utils import Cluster

        with self._unmarked():
            self.cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    **NODE,
                    **self._ports(),
                    "include_dashboard": False,
                    "_system_config": HEALTH,
                },
            )
            for _ in range(workers):
                self.cluster.add_node(**NODE, **self._ports(), resources=AGENT)
            self.cluster.wait_for_nodes()
        self.address: str = self.cluster.address

    @contextlib.contextmanager
    def _unmarked(self) -> Iterator[None]:
        """os.environ without any run's marker (what outlives the runs on purpose), with the
        cluster's home."""
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(leftovers.unmarked(saved), HOME=str(self.home))
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def _ports(self) -> dict[str, Any]:
        """Each node's own worker ports, away from the rendezvous' (see ``worker_ports``)."""
        self.started += 1
        return worker_ports(self.started - 1)

    def worker_nodes(self) -> list[Any]:
        return list(self.cluster.worker_nodes)

    def node_by_id(self, node_id: str) -> Any:
        for node in [self.cluster.head_node, *self.cluster.worker_nodes]:
            if node is not None and node.node_id == node_id:
                return node
        raise LookupError(f"no Ray node {node_id} in this cluster")

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
        with self._unmarked():
            node = self.cluster.add_node(**NODE, **self._ports(), resources=AGENT)
            self.cluster.wait_for_nodes()
        return str(node.node_id)

    def ray_node_of(self, run_dir: Path, node_id: str) -> str:
        """The Ray node the actor of ``node_id`` of the run in ``run_dir`` runs on, asked of
        the actor itself."""
        ray = import_ray()
        join(RayOptions(address=self.address))  # as the driver does: on loopback, as given
        actor = ray.get_actor(f"planaria.{run_dir.name}.{node_id}", namespace="planaria")
        return str(ray.get(actor.ready.remote(), timeout=30)["ray_node"])

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            import_ray().shutdown()
        self.cluster.shutdown()  # type: ignore[no-untyped-call]
        shutil.rmtree(self.home, ignore_errors=True)
