"""An emulated Kubernetes cluster on one machine: API server, scheduler and kubelet.

The API server is a real HTTP server (kmock's Kubernetes scaffold with the object store of
:mod:`.apiserver`), reached through the kubeconfig the cluster writes; pods bound to its nodes
run as processes of this machine (:mod:`.kubelet`), bound by :mod:`.scheduler`. A client of it
needs not know it is emulated::

    with EmulatedCluster(("kube-a", "kube-b")) as cluster:
        kubernetes.config.load_kube_config(str(cluster.kubeconfig))
        ...

Everything runs in one background thread with its own event loop; the methods below are safe to
call from any other thread.

**Every node a host of its own** (``hosts=True``, the default where the machine can make network
namespaces: as root, with iproute2). Each node gets a namespace of a
:class:`planaria.testing.netns.Network`, ``pl-<tag>-n<i>``, holding its address
``10.214.<k>.<i>``; the kubelet runs the node's pods inside it, and the node's ``InternalIP``
and its pods' ``podIP``/``hostIP`` are that address, so what a job learns from the cluster
routes to where its pods run, as on a real cluster, and two nodes' pods never share a port.
This machine joins the bridge at ``10.214.<k>.254`` (:attr:`EmulatedCluster.host_address`): the
API server listens there (not on every interface: it runs anything it is asked to), so the
harness and the pods reach it alike, and a master on this machine bound to ``0.0.0.0`` is
reached there by its agents. The namespaces share this machine's filesystem and ``/dev/shm``
(a pod sees its node's files and every other node's, as with a shared volume). Leaving the
cluster kills whatever still runs in them and removes the network: no namespace, link or
process is left. ``hosts=False`` (or a machine that cannot, with ``hosts=None``): every node and
pod is 127.0.0.1 and the API server listens there.

What it does not emulate (see each module for details): authentication (any token is accepted)
and authorization beyond :meth:`EmulatedCluster.forbid`; API groups other than core ``v1``
(pods, secrets, configmaps, events, serviceaccounts, nodes, namespaces); pagination (``limit`` is
ignored, lists are whole); validation beyond names and containers (a pod's spec may be changed by
an update); finalizers and foreground deletion; restarts (``restartPolicy`` is ``Never``), probes,
init containers, volumes, resource limits at run time, Services and pod networks beyond one
address per node (pods run as with ``hostNetwork: true``); node heartbeats, leases and evictions
of pods from lost nodes; preemption.

Why one module: :class:`EmulatedCluster` is the one handle a test holds on the cluster; its
methods are each a few lines that carry a test's request onto the cluster's thread, and the
parts they reach (the store, the scheduler, the kubelet, the network) are modules of their own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

import kmock
import kubernetes
import yaml

from planaria.testing import netns
from planaria_kubernetes.testing import semantics

if TYPE_CHECKING:
    from planaria_kubernetes import KubernetesScheduler
from planaria_kubernetes.testing.apiserver import ApiServer
from planaria_kubernetes.testing.kubelet import LOCALHOST, Kubelet
from planaria_kubernetes.testing.scheduler import Scheduler
from planaria_kubernetes.testing.semantics import Obj
from planaria_kubernetes.testing.store import KINDS, Store

T = TypeVar("T")

DEFAULT_ALLOCATABLE: Mapping[str, str] = {"cpu": "8", "memory": "32Gi", "pods": "110"}
UNREACHABLE_TAINT: Obj = {"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"}
VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")


class _Server(kmock.Server):
    """kmock's server without the aiohttp client session and the process-wide host-resolution
    interceptor it adds for tests that reach it by name through aiohttp: clients here connect by
    address, and clusters may then stop in any order."""

    async def __aenter__(self) -> _Server:
        server = self._server_cls(self.handler, host=self._host, port=self._port)
        self._managed_server = server
        await server.__aenter__()
        self.handler.servers.append(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.handler.servers.remove(self)
        server, self._managed_server = self._managed_server, None
        if server is not None:
            await server.__aexit__(exc_type, exc_value, traceback)


class EmulatedCluster:
    """A context manager: entering starts the cluster, leaving stops it and its processes.

    ``nodes`` are the Node objects (labels ``kubernetes.io/hostname=<name>`` and the node's
    ``node_labels``, Ready, with ``allocatable`` as capacity); ``namespace`` is created (with
    ``default``) and is the kubeconfig context's namespace; pods' output goes to ``log_dir`` (a
    temporary directory, removed on exit, when not given). ``hosts``: every node a host of its
    own (see the module docstring); True requires it (``RuntimeError`` saying why the machine
    cannot), None (the default) has it where the machine can.

    Attributes: ``url`` (``http://<host address>:<port>``), ``kubeconfig`` (its path; context
    ``emulated``, any token), ``namespace``, ``log_dir``, ``requests`` (``(method, path?query)``
    of every API request received, the query percent-encoded as sent), ``errors``, ``network``
    (the :class:`~planaria.testing.netns.Network` of the nodes, None without ``hosts``).
    """

    def __init__(
        self,
        nodes: Sequence[str] = ("kube-a", "kube-b", "kube-c"),
        *,
        namespace: str = "planaria",
        allocatable: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
        hosts: bool | None = None,
        node_labels: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self.node_names = tuple(nodes)
        self.node_labels = {n: dict(labels) for n, labels in (node_labels or {}).items()}
        unknown = sorted(set(self.node_labels) - set(self.node_names))
        if unknown:
            raise ValueError(
                f"node_labels for {', '.join(unknown)}: no such node (the nodes are "
                f"{', '.join(self.node_names)})"
            )
        self.hosts = hosts
        self.network: netns.Network | None = None
        self.namespace = namespace
        self.allocatable = dict(allocatable if allocatable is not None else DEFAULT_ALLOCATABLE)
        self._workdir = Path(tempfile.mkdtemp(prefix="emulated-kubernetes-"))
        self.log_dir = Path(log_dir) if log_dir is not None else self._workdir / "logs"
        self.kubeconfig = self._workdir / "kubeconfig"
        self.url = ""
        self.server = ApiServer(pod_logs=self.log_dir)
        self.requests: list[tuple[str, str]] = self.server.log
        self.kubelet = Kubelet(
            store=self.server.store, nodes=set(self.node_names), log_dir=self.log_dir
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._started: concurrent.futures.Future[str] = concurrent.futures.Future()

    @property
    def store(self) -> Store:
        return self.server.store

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def host_address(self) -> str:
        """This machine's address as the nodes reach it (127.0.0.1 without ``hosts``)."""
        return self.network.host_address if self.network is not None else LOCALHOST

    def node_address(self, node: str) -> str:
        """The address of node ``node`` (its ``InternalIP``, its pods' ``podIP``)."""
        if node not in self.node_names:
            raise KeyError(f"no node {node!r} in this cluster: it has {', '.join(self.node_names)}")
        return self.kubelet.address(node)

    def __enter__(self) -> EmulatedCluster:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._make_network()
            self._thread = threading.Thread(
                target=self._main, name="emulated-kubernetes", daemon=True
            )
            self._thread.start()
            self.url = self._started.result(timeout=30)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "emulated", "cluster": {"server": self.url}}],
                    "users": [{"name": "emulated", "user": {"token": "emulated"}}],
                    "contexts": [
                        {
                            "name": "emulated",
                            "context": {
                                "cluster": "emulated",
                                "user": "emulated",
                                "namespace": self.namespace,
                            },
                        }
                    ],
                    "current-context": "emulated",
                }
            )
        )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        loop, stop, thread = self._loop, self._stop, self._thread
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        if thread is not None:
            thread.join(timeout=60)
        self.kubelet.stop()  # in case the loop could not (it is idempotent)
        network, self.network = self.network, None
        if network is not None:
            network.close()  # whatever a pod left behind in a namespace is killed
        if self._workdir.exists():
            shutil.rmtree(self._workdir, ignore_errors=True)

    def _make_network(self) -> None:
        """The nodes' namespaces (see the module docstring), named by number: a node's name
        need not fit a link name's 15 characters."""
        if not self.node_names and not self.hosts:
            return  # an API server alone (a benchmark of the scheduler's calls): no host to be
        why = netns.unavailable() if self.hosts is not False else "hosts=False"
        if why is not None:
            if self.hosts:
                raise RuntimeError(f"emulated nodes cannot be hosts of their own here: {why}")
            return
        members = {node: f"n{number}" for number, node in enumerate(self.node_names)}
        network = netns.Network(list(members.values()), host=True)
        network.create()
        self.network = network
        self.kubelet.addresses = {node: network.address(m) for node, m in members.items()}
        self.kubelet.netns = {node: network.netns(m) for node, m in members.items()}

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:
            if not self._started.done():
                self._started.set_exception(exc)
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        store = self.store
        store.create("namespaces", None, {"metadata": {"name": "default"}})
        if self.namespace != "default":
            store.create("namespaces", None, {"metadata": {"name": self.namespace}})
        for name in self.node_names:
            store.create("nodes", None, self._node(name))
        scheduler = Scheduler(store)
        async with self.server, _Server(self.server, host=self.host_address) as server:
            tasks = [
                asyncio.create_task(scheduler.run(), name="scheduler"),
                asyncio.create_task(self.kubelet.run(), name="kubelet"),
            ]
            self._started.set_result(str(server.url).rstrip("/"))
            try:
                await self._stop.wait()
            finally:
                for task in tasks:
                    task.cancel()
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                self.kubelet.stop()
                store.close_watches()
                await asyncio.sleep(0.05)  # let the watches end their streams

    def _node(self, name: str) -> Obj:
        stamp = semantics.timestamp()
        return {
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    **self.node_labels.get(name, {}),
                },
            },
            "spec": {},
            "status": {
                "capacity": dict(self.allocatable),
                "allocatable": dict(self.allocatable),
                "conditions": [_ready_condition(True, stamp)],
                "addresses": [
                    {"type": "InternalIP", "address": self.kubelet.address(name)},
                    {"type": "Hostname", "address": name},
                ],
                "nodeInfo": {
                    "architecture": "amd64",
                    "bootID": "",
                    "containerRuntimeVersion": "emulated://1",
                    "kernelVersion": "",
                    "kubeProxyVersion": "",
                    "kubeletVersion": "v1.31.0",
                    "machineID": "",
                    "operatingSystem": "linux",
                    "osImage": "emulated",
                    "systemUUID": "",
                },
            },
        }

    # -- calling into the loop ----------------------------------------------------------------

    def _call(self, function: Callable[[], T], timeout: float = 30) -> T:
        loop = self._loop
        if loop is None or self._stop is None:
            raise RuntimeError("the cluster is not running")

        async def run() -> T:
            return function()

        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout)

    # -- for tests ----------------------------------------------------------------------------

    @property
    def errors(self) -> list[str]:
        """Tracebacks of the emulation's own failures (none expected; also logged)."""
        return list(self.store.errors)

    def api(self) -> kubernetes.client.ApiClient:
        """A client configured for this cluster (from its kubeconfig)."""
        client = kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(self.kubeconfig)
        )
        return cast(kubernetes.client.ApiClient, client)

    def set_node_ready(self, node: str, ready: bool, *, kill: bool = False) -> None:
        """Make a node Ready again, or not Ready: its kubelet stops (its pods stay as they are,
        even when deleted), its Ready condition becomes ``Unknown`` with reason
        ``NodeStatusUnknown`` and the ``node.kubernetes.io/unreachable:NoSchedule`` taint is added
        (as the node lifecycle controller does), and its pods' ``Ready`` conditions become
        ``False``. With ``kill``, its processes are SIGKILLed too (a dead machine rather than a
        cut one); they are reported (exit code 137) if the node comes back."""

        def change() -> None:
            stamp = semantics.timestamp()

            def node_status(obj: Obj) -> None:
                status = obj.setdefault("status", {})
                conditions = [c for c in status.get("conditions") or [] if c.get("type") != "Ready"]
                status["conditions"] = [*conditions, _ready_condition(ready, stamp)]
                spec = obj.setdefault("spec", {})
                taints = [
                    t for t in spec.get("taints") or [] if t.get("key") != UNREACHABLE_TAINT["key"]
                ]
                if not ready:
                    taints.append({**UNREACHABLE_TAINT, "timeAdded": stamp})
                if taints:
                    spec["taints"] = taints
                else:
                    spec.pop("taints", None)

            if self.store.mutate("nodes", None, node, node_status) is None:
                raise KeyError(node)
            if ready:
                self.kubelet.down.discard(node)
                return
            self.kubelet.down.add(node)
            if kill:
                self.kubelet.kill_node(node)
            for pod in self.store.all("pods"):
                if (pod.get("spec") or {}).get("nodeName") != node:
                    continue

                def not_ready(obj: Obj) -> None:
                    for condition in (obj.get("status") or {}).get("conditions") or []:
                        if condition.get("type") == "Ready" and condition.get("status") == "True":
                            condition.update(
                                status="False", reason="NodeNotReady", lastTransitionTime=stamp
                            )

                meta = pod["metadata"]
                self.store.mutate("pods", meta.get("namespace"), meta["name"], not_ready)

        self._call(change)

    def scheduler(self, **options: Any) -> KubernetesScheduler:
        """A scheduler of this cluster's namespace, through its kubeconfig (pods of image
        ``planaria-test:1``, stopped with a grace of 0.5 s, unless ``options`` say otherwise)."""
        from planaria_kubernetes import KubernetesOptions, KubernetesScheduler

        settings: dict[str, Any] = {"image": "planaria-test:1", "stop_grace": 0.5, **options}
        return KubernetesScheduler(
            KubernetesOptions(kubeconfig=str(self.kubeconfig), namespace=self.namespace, **settings)
        )

    def bad_image(self, image: str) -> None:
        """Pods with this image cannot pull it: ``ErrImagePull``, then ``ImagePullBackOff``."""
        self._call(lambda: self.kubelet.bad_images.add(image))

    def forbid(self, verb: str, resource: str) -> None:
        """Requests of ``verb`` (get, list, watch, create, update, patch, delete,
        deletecollection) on ``resource`` (``pods``, ``pods/status``, ``nodes``...) get
        ``403 Forbidden``."""
        if verb not in VERBS or resource.split("/")[0] not in KINDS:
            raise ValueError(f"unknown verb or resource: {verb} {resource}")
        self._call(lambda: self.store.forbidden.add((verb, resource)))

    def allow(self, verb: str, resource: str) -> None:
        """Undo :meth:`forbid`."""
        self._call(lambda: self.store.forbidden.discard((verb, resource)))

    def expire_watches(self) -> None:
        """End every open watch now; resuming a watch (from a version up to the current one)
        gets ``410 Expired``. The current version moves on, so a relist gets one to resume from."""
        self._call(self.store.expire_watches)

    def objects(self, plural: str) -> list[dict[str, Any]]:
        """The current raw objects of a resource (``"pods"``, ``"secrets"``, ``"nodes"``...)."""
        return self._call(lambda: self.store.all(plural))

    def pod(self, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """The current raw object of a pod of the namespace, ``None`` if there is none."""
        return self._call(lambda: self.store.find("pods", namespace or self.namespace, name))

    def pod_pids(self, name: str, namespace: str | None = None) -> list[int]:
        """The live processes of a pod (its process group); empty when none runs."""
        return self._call(lambda: self.kubelet.pids(namespace or self.namespace, name))

    def pod_log(self, name: str, namespace: str | None = None) -> str:
        """What the pod's processes wrote (stdout and stderr) so far."""
        path = self.log_dir / f"{namespace or self.namespace}.{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait(self, predicate: Callable[[], T], timeout: float, what: str) -> T:
        """Poll ``predicate`` until it returns something truthy, and return that; raise
        ``TimeoutError`` naming ``what`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            result = predicate()
            if result:
                return result
            if time.monotonic() >= deadline:
                raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.05)


def _ready_condition(ready: bool, stamp: str) -> Obj:
    if ready:
        return {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "kubelet is posting ready status",
            "lastHeartbeatTime": stamp,
            "lastTransitionTime": stamp,
        }
    return {
        "type": "Ready",
        "status": "Unknown",
        "reason": "NodeStatusUnknown",
        "message": "Kubelet stopped posting node status.",
        "lastHeartbeatTime": stamp,
        "lastTransitionTime": stamp,
    }
