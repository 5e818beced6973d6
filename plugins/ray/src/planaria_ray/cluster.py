"""Reaching the Ray cluster: joining one that runs, or starting one on this machine.

Joining is bounded in time: the cluster's address is probed over TCP first (``ray.init``
against an address nobody answers retries for a minute or more), then joined with
``connect_timeout``. A driver joins once per process: ``ray.init`` is process-wide, so a
later scheduler of the same process (a test session, ``planaria check`` then ``run``) uses the
connection that is there.

Without an address a local cluster is started for this run (a laptop run): one Ray node per
agent (``local_nodes``, or as many as the first launch asks for), each declaring exactly one
agent's resources, without the dashboard, with a small object store (the
agents pass nothing through it), on loopback only. It ends with the job's
:meth:`RayScheduler.stop`.

A cluster on loopback (its nodes started with ``--node-ip-address=127.0.0.1``, listening on
127.0.0.1 alone) needs one thing of the driver: Ray rewrites a GCS address of 127.0.0.1,
``localhost`` or ``::1`` to the machine's primary address before connecting (so that what it
registers is reachable from other machines), where nobody of that cluster listens, and
``ray.init`` then retries for minutes. Ray leaves loopback alone when multi-node clusters are
off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read once at import); a loopback address is a
one-machine cluster, so the driver turns that off before joining one.

A driver attaches to a raylet of its own machine, and its core worker is called back at that
raylet's address. Ray picks the raylet among those it finds running here (the head's, when
there are several) unless told the driver's address. Where several Ray nodes share this
machine's processes but not its network (nodes in network namespaces or containers of their
own), the head's address is no address of the driver's: the driver names its own, the local
address of its route to the GCS, when a raylet here was started at that address
(:func:`driver_address`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from planaria.agent.address import route_source
from planaria.errors import SchedulerError
from planaria_ray.options import RayOptions

OBJECT_STORE_BYTES = 100 * 1024 * 1024
"""The local cluster's object store per node: Ray's minimum is 75 MiB."""
CURRENT_CLUSTER = Path("/tmp/ray/ray_current_cluster")
"""Where ``ray start --head`` writes the address of the cluster it started."""
LOOPBACK = "127.0.0.1"
"""The local cluster's node address: nothing of it listens beyond this machine."""
WORKER_PORTS = (10002, 19999)
"""Where Ray's worker processes bind on a cluster that ``ray start`` starts: below the
kernel's ephemeral range (32768 up), from which a rendezvous takes the port it gives
torch.distributed. Ray's in-process clusters bind their workers at random ephemeral ports
instead; with a new worker process for every actor, one of them sometimes takes the port a
rendezvous has just chosen, and the job's workers fail on it (``EADDRINUSE``)."""
WORKER_PORTS_PER_NODE = 500


def worker_ports(index: int) -> dict[str, int]:
    """The worker port range of the ``index``-th Ray node started on this machine: ranges
    of nodes on one machine do not overlap (a worker's port is free within its raylet's
    pool, not the machine's). Past the 19th node, ranges are used again."""
    low, high = WORKER_PORTS
    blocks = (high - low + 1) // WORKER_PORTS_PER_NODE
    first = low + (index % blocks) * WORKER_PORTS_PER_NODE
    return {"min_worker_port": first, "max_worker_port": first + WORKER_PORTS_PER_NODE - 1}


class RayMissing(SchedulerError):
    """Ray cannot be imported in this environment."""


def import_ray() -> ModuleType:
    """The ``ray`` module, or :class:`RayMissing` saying how to get it."""
    try:
        import ray
    except ImportError as exc:
        raise RayMissing(
            f"Ray is not installed here ({exc}): `pip install 'ray>=2.10'`, the same version "
            "as the cluster's (`ray --version` on its head node)"
        ) from None
    return ray


def gcs_endpoint(address: str) -> tuple[str, int]:
    """Host and port that ``address`` makes ``ray.init`` connect to (the GCS, or the Ray
    Client server for ``ray://``)."""
    where = address
    if address == "auto":
        where = os.environ.get("RAY_ADDRESS", "")
        if not where and CURRENT_CLUSTER.exists():
            where = CURRENT_CLUSTER.read_text().strip()
        if not where or where == "auto":
            raise SchedulerError(
                "scheduler.options.address is `auto`, but no Ray cluster was started on this "
                f"machine ({CURRENT_CLUSTER} is missing and RAY_ADDRESS is not set): start one "
                "with `ray start --head`, or give the head node's address"
            )
    where = where.removeprefix("ray://")
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit():
        raise SchedulerError(
            f"scheduler.options.address {address!r} is not `auto`, `ray://HOST:PORT` or "
            "HOST:PORT (the head node's GCS address, e.g. 10.0.0.1:6379)"
        )
    return host.strip("[]"), int(port)


def probe(address: str, timeout: float) -> None:
    """Raise :class:`SchedulerError` unless something accepts connections at ``address``."""
    host, port = gcs_endpoint(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        raise SchedulerError(
            f"cannot reach the Ray cluster at {address} ({host}:{port}: "
            f"{exc.strerror or exc}): is it running (`ray status --address {host}:{port}`)?"
        ) from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (127.0.0.0/8, ``::1``, ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def keep_loopback(ray: ModuleType) -> None:
    """Make ``ray.init`` connect to a loopback GCS address as given, not at the machine's
    primary address (see the module's docstring). Ray reads the switch as
    ``ray_constants.ENABLE_RAY_CLUSTER`` when it resolves the address; the process's
    environment is left as it is, so nothing the driver starts inherits it."""
    constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
    if constants is not None and hasattr(constants, "ENABLE_RAY_CLUSTER"):
        constants.ENABLE_RAY_CLUSTER = False


def join(options: RayOptions) -> None:
    """Connect this process to the cluster at ``options.address`` (once per process)."""
    ray = import_ray()
    if ray.is_initialized():
        return
    assert options.address is not None
    probe(options.address, options.connect_timeout)
    address = options.address
    if address == "auto":
        host, port = gcs_endpoint(address)
        address = f"{host}:{port}"
    _init(ray, address, options)


def raylet_addresses(proc: Path = Path("/proc")) -> set[str]:
    """The node addresses (``--node_ip_address``) of the raylets running on this machine."""
    found = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if not argv[0].endswith(b"/raylet") and argv[0] != b"raylet":
                continue
            for arg in argv[1:]:
                if arg.startswith(b"--node_ip_address="):
                    found.add(arg.split(b"=", 1)[1].decode(errors="replace"))
    return found


def driver_address(gcs_host: str) -> str | None:
    """The driver's own node address for a cluster whose GCS is at ``gcs_host``: the local
    address of the route there, when a raylet of this machine was started at it; else None
    (Ray's own choice: the raylet it finds here)."""
    try:
        source = route_source(gcs_host)
    except (OSError, UnicodeError):
        return None
    if is_loopback(source) or source not in raylet_addresses():
        return None
    return source


def _init(ray: ModuleType, address: str, options: RayOptions) -> None:
    started = time.monotonic()
    own = None
    if not address.startswith("ray://"):
        host = gcs_endpoint(address)[0]
        if is_loopback(host):
            keep_loopback(ray)
        else:
            own = driver_address(host)
    try:
        ray.init(
            address=address,
            namespace=options.namespace,
            log_to_driver=False,
            logging_level="WARNING",
            configure_logging=False,
            **({"_node_ip_address": own} if own else {}),
        )
    except Exception as exc:
        raise SchedulerError(
            f"cannot join the Ray cluster at {address} after "
            f"{time.monotonic() - started:.1f}s: {exc}"
        ) from None


def start_local(options: RayOptions, nodes: int) -> Any:
    """Start a local cluster of ``nodes`` Ray nodes, each with one agent's resources, and
    connect to it; returns the cluster (``ray.cluster_utils.Cluster``) to shut down."""
    ray = import_ray()
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # A cluster of this run's own: no usage report, no cloud metadata queries (unless asked).
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    node: dict[str, Any] = {
        "num_cpus": options.num_cpus,
        "num_gpus": options.num_gpus,
        "resources": dict(options.resources),
        "object_store_memory": OBJECT_STORE_BYTES,
        "node_ip_address": LOOPBACK,
    }
    if options.memory:
        node["memory"] = options.memory
    try:
        cluster: Any = Cluster(
            initialize_head=True,
            head_node_args={**node, **worker_ports(0), "include_dashboard": False},
        )
        for index in range(1, max(1, nodes)):
            cluster.add_node(**node, **worker_ports(index))
        cluster.wait_for_nodes()
    except Exception as exc:
        raise SchedulerError(f"cannot start a local Ray cluster of {nodes} node(s): {exc}") from exc
    try:
        _init(ray, cluster.address, options)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def alive_nodes() -> list[dict[str, Any]]:
    """The cluster's live nodes, as ``ray.nodes()`` shows them."""
    ray = import_ray()
    return [n for n in ray.nodes() if n.get("Alive")]


RAY_LABELS = "ray.io/"
"""The prefix of the labels Ray puts on every node itself (``ray.io/node-id``...)."""


def node_topology(node: dict[str, Any], wanted: list[str] | None) -> dict[str, str]:
    """The topology of a Ray node (a ``ray.nodes()`` entry): its labels (``ray start
    --labels``) named in ``wanted``, or, without ``wanted``, every label but Ray's own. A
    node without labels (or a Ray that has none) has none."""
    labels = node.get("Labels") or {}
    if wanted is None:
        return {k: str(v) for k, v in labels.items() if not k.startswith(RAY_LABELS)}
    return {k: str(labels[k]) for k in wanted if k in labels}


def fits(node: dict[str, Any], demand: dict[str, float]) -> bool:
    """Whether the node has ``demand`` in all (its total, busy or not)."""
    have = node.get("Resources", {})
    return all(have.get(name, 0.0) >= amount for name, amount in demand.items())


def describe(nodes: list[dict[str, Any]]) -> str:
    """The nodes' resources, for an error message."""
    shown = []
    for node in nodes[:8]:
        have = {
            k: (int(v) if float(v).is_integer() else v)
            for k, v in sorted(node.get("Resources", {}).items())
            if not k.startswith("node:") and k != "object_store_memory"
        }
        shown.append(f"{node['NodeID'][:12]} {have}")
    more = f" and {len(nodes) - 8} more" if len(nodes) > 8 else ""
    return "; ".join(shown) + more
