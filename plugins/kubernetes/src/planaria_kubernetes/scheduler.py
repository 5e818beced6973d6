"""The ``kubernetes`` scheduler: the master creates one pod per node itself and watches them.

No operator and no custom resource: the master (``planaria run``, in a pod of its own or
anywhere with a kubeconfig) creates the job's pods with the official client, typed with its
models (:mod:`planaria_kubernetes.pods`), and follows them with a list-then-watch
(:class:`~planaria_kubernetes.informer.Informer`) of its run's pods and of the cluster's nodes.

- **Launch.** One Secret holds the job's token (the pods read it through ``secretKeyRef``; it is
  never in a pod spec or a log line), then the pods are created ``parallelism`` at once.
  ``launch`` returns once every pod runs, so that what cannot start is an error of the launch,
  naming the pod and Kubernetes' reason: no node fits for ``schedule_timeout`` (``0/3 nodes are
  available: ...``), an image that cannot be pulled or a container that cannot be made for
  ``start_timeout``, a pod the API server refuses (RBAC). The pods already made are deleted.
- **Loss.** A pod that failed (its agent's exit code; 128+N when a signal N killed it), was
  evicted or deleted by someone else, or whose node turns NotReady or goes away, is reported
  ``lost`` with the reason. Pods have ``restartPolicy: Never``: the master alone decides what
  replaces a node.
- **Replace.** The new pod has a required node affinity ``kubernetes.io/hostname NotIn`` every
  excluded host, and (``one_per_node``) a required pod anti-affinity against the run's other
  pods. With ``cordon: true`` a node diagnosed faulty is also cordoned; a permission error
  there is a warning, never a failure.
- **Topology.** A node's handle carries the labels ``topology_labels`` names, read off the
  Kubernetes node its pod is bound to (the node watch has them: no request of its own), for a
  rank placement by switch (``rendezvous.backend: topology``).
- **Ownership.** Every pod has an owner reference: to the master's own pod when it runs in one
  (deleting the master deletes the job), to a configured owner, or else to the token Secret.

The node table, ids, events and excluded hosts are the scheduler engine's
(:mod:`planaria.scheduler.engine`); Kubernetes picks the machine, so ``place`` names none and
a node's host is the one its pod is bound to, as the watches see it. The watches run on
threads of their own: they write what they see into each node's :class:`_Pod`, under a lock,
and :meth:`KubernetesScheduler.observe` turns that into events.

Why one module: it is one backend of the engine, and what it adds to it is one idea, a node
as a pod that the watches follow; `launch` and `replace` extend the engine's templates because
a job's pods are created together (``parallelism`` at once) and a launch or a replacement ends
only once its pods run, which is where Kubernetes says what cannot start.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from planaria import leftovers
from planaria.errors import ConfigIssue
from planaria.log import get_logger
from planaria.plugin import (
    EngineNode,
    EngineScheduler,
    LaunchSpec,
    NodeEvent,
    NodeHandle,
    NodeState,
    SchedulerError,
)
from planaria.shm import TAG_ENV
from planaria_kubernetes import api, pods
from planaria_kubernetes.informer import Informer
from planaria_kubernetes.options import KubernetesOptions, OwnerRef

log = get_logger("scheduler.kubernetes")

CANNOT_START = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
"""Reasons a scheduled pod's container waits with, that only time (``start_timeout``) turns
into a failure: an image registry can come back, a Secret can be created meanwhile."""
_GONE_WAIT = 15.0
"""Beyond ``stop_grace``: how long stopping every node waits for the pods to be gone."""


@dataclass(eq=False)
class _Pod:
    """A node's pod, as the watches saw it: the engine's data of a Kubernetes node. The
    informer threads write it (under the scheduler's lock); :meth:`KubernetesScheduler.observe`
    turns it into events."""

    name: str
    host: str = ""
    """The Kubernetes node the pod is bound to; empty until it is scheduled."""
    created: bool = False
    running: bool = False
    end: tuple[NodeState, str] | None = None
    """How it ended, as first seen: nothing later changes it."""
    unschedulable: str = ""
    unschedulable_since: float | None = None
    waiting: str = ""
    waiting_since: float | None = None
    deleting: bool = False
    """The scheduler asked for its deletion."""
    gone: bool = False

    @property
    def settled(self) -> bool:
        return self.running or self.end is not None


_K8sNode = EngineNode[_Pod]


def _exit(pod: dict[str, Any]) -> tuple[NodeState, str]:
    """A finished pod's state and why, from its container's termination."""
    name = pod["metadata"]["name"]
    statuses = pod.get("status", {}).get("containerStatuses") or []
    terminated = next(
        (s["state"]["terminated"] for s in statuses if (s.get("state") or {}).get("terminated")),
        None,
    )
    if pod.get("status", {}).get("phase") == "Succeeded":
        return NodeState.SUCCEEDED, ""
    if terminated is None:
        said = pod.get("status", {}).get("message") or "no container status"
        return NodeState.LOST, f"pod {name} failed: {said}"
    code = int(terminated.get("exitCode") or 0)
    reason = terminated.get("reason") or "Error"
    if code >= 128:
        return NodeState.LOST, f"pod {name}: its agent was killed by signal {code - 128} ({reason})"
    return NodeState.FAILED, f"pod {name}: its agent exited with code {code} ({reason})"


def _waiting(pod: dict[str, Any]) -> str:
    for status in pod.get("status", {}).get("containerStatuses") or []:
        waiting = (status.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in CANNOT_START:
            return f"{waiting['reason']}: {waiting.get('message') or ''}".rstrip(": ")
    return ""


def _unschedulable(pod: dict[str, Any]) -> str:
    for condition in pod.get("status", {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return f"{condition.get('reason') or 'Unschedulable'}: {condition.get('message') or ''}"
    return ""


def node_topology(node: dict[str, Any], wanted: dict[str, str]) -> dict[str, str]:
    """The topology of a Kubernetes node (its JSON): for each planaria label of ``wanted``,
    the value of the node label it names, where the node has one."""
    labels = node.get("metadata", {}).get("labels") or {}
    return {name: str(labels[key]) for name, key in wanted.items() if key in labels}


def _ready(node: dict[str, Any]) -> tuple[bool, str]:
    for condition in node.get("status", {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            why = f"{condition.get('reason') or ''}: {condition.get('message') or ''}".strip(": ")
            return condition.get("status") == "True", why
    return False, "it has no Ready condition"


class KubernetesScheduler(EngineScheduler[KubernetesOptions, _Pod]):
    """Nodes are pods (see the module docstring). The engine (:mod:`planaria.scheduler.engine`)
    keeps the nodes, their events and the excluded hosts; this class creates, watches and
    deletes the pods, and keeps the Secret, the watches, the owner and cordons."""

    name = "kubernetes"
    nodes_here = False

    @classmethod
    def capacity_issues(
        cls, options: KubernetesOptions, *, nodes: int, procs_per_node: int
    ) -> list[ConfigIssue]:
        """The cluster must be reachable and its namespace readable, before anything starts."""
        try:
            client = api.connect(options)
        except SchedulerError as exc:
            return [ConfigIssue("scheduler.options.kubeconfig", str(exc))]
        from kubernetes import client as k8s

        namespace = api.namespace(options)
        try:
            with client:
                k8s.CoreV1Api(client).list_namespaced_pod(
                    namespace, limit=1, _request_timeout=min(options.request_timeout, 10)
                )
        except Exception as exc:
            code, said = api.status_of(exc)
            where = client.configuration.host
            if code == 0:
                return [
                    ConfigIssue(
                        "scheduler.options.kubeconfig",
                        f"cannot reach the Kubernetes API server at {where}: {said}",
                    )
                ]
            return [
                ConfigIssue(
                    "scheduler.options.namespace",
                    f"cannot list pods in namespace {namespace!r} at {where}: {said}",
                )
            ]
        return []

    def __init__(self, options: KubernetesOptions) -> None:
        super().__init__(options)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._seen = False
        """A watch saw a change that :meth:`observe` has not looked at yet."""
        self._by_pod: dict[str, _Pod] = {}
        self._client: Any = None
        self._core: Any = None
        self._namespace = ""
        self._spec: LaunchSpec | None = None
        self._owner_ref: OwnerRef | None = None
        self._secret_made = False
        self._pods_owner: OwnerRef | None = None
        """Without an owner: the token Secret, made first, owns the pods."""
        self._informers: list[Informer] = []
        self._pods_informer: Informer | None = None
        self._cluster_nodes: dict[str, dict[str, Any]] = {}

    # -- the Scheduler interface, beyond the engine's ---------------------------------------

    def launch(self, spec: LaunchSpec, count: int) -> list[NodeHandle]:
        """Create ``count`` pods and wait until they run (see the module docstring): the
        engine hands out the nodes, then their pods are created ``parallelism`` at once."""
        if count > 0 and spec.command:
            self.check_interrupted("cannot launch nodes")
            self._connect(spec)
            self._ensure_secret(spec)
        handles: list[NodeHandle] = []
        try:
            handles = super().launch(spec, count)
            nodes = [self.node(h.node_id) for h in handles]
            if nodes:
                self._create(nodes)
                self._await(nodes, running=True)
        except BaseException:
            self.stop([h.node_id for h in handles])
            if self._core is not None and all(n.released for n in self.nodes.values()):
                self.stop()  # nothing of the job may be left: its Secret neither
            raise
        return [self._placed(h) for h in handles]

    def replace(self, node_id: str, *, exclude_host: bool) -> NodeHandle:
        """Delete ``node_id``'s pod and create its successor, kept off every excluded host
        and, while another node can take it, off the old one's; returns once the new pod is
        scheduled."""
        old = self.node(node_id)
        soft = [] if exclude_host or not old.host else [old.host]
        handle = super().replace(node_id, exclude_host=exclude_host)
        new = self.node(handle.node_id)
        try:
            self._create([new], soft)
            if not self._await([new], running=False, quick=bool(soft)):
                # Kubernetes finds no node but the old one's: there, when it is not excluded.
                self._delete([new], grace=0.0)
                self._await_gone([new], self.options.request_timeout)
                new.data = self._new_pod(new)
                self._create([new])
                self._await([new], running=False)
        except BaseException as exc:
            self.stop([new.node_id])
            if isinstance(exc, SchedulerError):
                raise SchedulerError(f"cannot replace {node_id}: {exc}") from exc
            raise
        handle = self._placed(handle)
        log.info(
            "replacement scheduled", node=node_id, replacement=new.node_id, k8s_node=handle.host
        )
        return handle

    def adopt(self, spec: LaunchSpec, handles: list[NodeHandle], excluded: set[str]) -> None:
        """Find a restarted master's pods again by name; one that is gone is reported lost."""
        self._connect(spec)
        self._secret_made = True  # the earlier master made it; the job still needs it
        if self._owner_ref is None:  # then the Secret owns the pods: so it does the new ones
            try:
                secret = self._core.read_namespaced_secret(
                    pods.secret_name(spec),
                    self._namespace,
                    _request_timeout=self.options.request_timeout,
                )
            except Exception as exc:
                raise api.error(
                    f"cannot read the job's Secret {pods.secret_name(spec)}", exc
                ) from exc
            self._pods_owner = OwnerRef(
                api_version="v1", kind="Secret", name=secret.metadata.name, uid=secret.metadata.uid
            )
        self.keep_excluded(excluded)
        assert self._pods_informer is not None
        stale = []
        with self._lock:
            for handle in handles:
                record = _Pod(pods.pod_name(spec, handle.node_id), host=handle.host, created=True)
                node = self.add_adopted(handle, spec, record)
                self._by_pod[record.name] = record
                current = self._pods_informer.objects.get(record.name)
                if handle.state is NodeState.LOST:  # out of the job: its pod must go
                    record.gone = current is None
                    if current is not None:
                        stale.append(node)
                elif current is None:
                    record.gone = True
                    record.end = (NodeState.LOST, f"its pod {record.name} is gone")
                else:
                    self._observe_pod(record, current)
                    log.info("node adopted", node=node.node_id, pod=record.name)
        self._delete(stale, self.stop_grace)

    def node_addresses(self) -> list[str]:
        """The ``InternalIP`` of every Ready, schedulable node of the cluster that the pods'
        ``node_selector`` admits: a master outside the cluster bound to every interface tells
        its agents the address it reaches these from. None when the nodes cannot be listed
        (the master then falls back to its default route)."""
        from kubernetes import client

        try:
            with api.connect(self.options) as connection:
                found = client.CoreV1Api(connection).list_node(
                    _request_timeout=min(self.options.request_timeout, 10)
                )
        except Exception as exc:
            _, said = api.status_of(exc)
            log.info("cannot list the kubernetes nodes for their addresses", error=said)
            return []
        wanted = dict(self.options.node_selector)
        addresses = []
        for node in found.items:
            labels = (node.metadata and node.metadata.labels) or {}
            if any(labels.get(k) != v for k, v in wanted.items()):
                continue
            conditions = (node.status and node.status.conditions) or []
            ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
            if (node.spec and node.spec.unschedulable) or not ready:
                continue
            for address in (node.status and node.status.addresses) or []:
                if address.type == "InternalIP" and address.address not in addresses:
                    addresses.append(address.address)
        return addresses

    # -- the engine's backend -------------------------------------------------------------

    def place(self, node: _K8sNode, avoid: frozenset[str], replacing: _K8sNode | None) -> str:
        """No host: Kubernetes picks the machine (``node.avoid`` becomes the pod's node
        anti-affinity), and :meth:`observe` says which once the pod is bound."""
        return ""

    def start(self, node: _K8sNode) -> _Pod:
        """The node's pod, to be created: :meth:`launch` and :meth:`replace` create the pods
        they asked for together, ``parallelism`` at once, and wait for them."""
        return self._new_pod(node)

    def handle_data(self, node: _K8sNode) -> dict[str, str]:
        assert node.data is not None
        return {"pod": node.data.name, "namespace": self._namespace}

    def handle_topology(self, node: _K8sNode) -> dict[str, str]:
        """The ``topology_labels`` of the Kubernetes node the pod is bound to, as the node
        watch last saw it; empty until the pod is bound, and for a node without them."""
        with self._lock:
            host = (node.data.host if node.data is not None else "") or node.host
            return node_topology(self._cluster_nodes.get(host, {}), self.options.topology_labels)

    def terminate(self, nodes: list[_K8sNode], grace: float) -> None:
        """Delete the nodes' pods (their agents get SIGTERM, SIGKILL after ``grace``); the
        kubelets stop them. Stopping every node waits until they are gone (:meth:`after_stop`)."""
        self._delete(nodes, grace)

    def observe(self) -> list[NodeEvent]:
        """What the watches saw of each node's pod since the last call; a pod that cannot
        start (``schedule_timeout``, ``start_timeout``) fails, and is deleted: it must not hold
        a node's resources, or wait for ever."""
        events = []
        stuck = []
        with self._lock:
            self._seen = False
            now = time.monotonic()
            for node in self.nodes.values():
                pod = node.data
                if pod is None or node.released or node.ended:
                    continue
                node.host = pod.host or node.host
                if pod.running and node.state is NodeState.PENDING:
                    events.append(NodeEvent(node_id=node.node_id, state=NodeState.RUNNING))
                    log.info("node running", node=node.node_id, pod=pod.name, k8s_node=node.host)
                end = pod.end
                why = "" if end else self._cannot_start(pod, now)
                if why:
                    end = (NodeState.FAILED, why)
                    stuck.append(node)
                if end:
                    events.append(NodeEvent(node_id=node.node_id, state=end[0], reason=end[1]))
                    log.info("node ended", node=node.node_id, state=end[0].value, reason=end[1])
        self._delete(stuck, self.stop_grace)
        return events

    def wait(self, remaining: float) -> None:
        """Sleep until a watch sees a change, at most ``remaining`` seconds (half a second at
        most: time alone makes a pod that cannot start fail)."""
        with self._lock:
            if not self._seen:
                self._changed.wait(min(remaining, 0.5))

    def on_exclude(self, host: str, why: str) -> None:
        """With ``cordon``, no pod of anyone's lands on the host any more."""
        if self.options.cordon:
            self._cordon(host)

    def after_stop(self, nodes: list[_K8sNode], everything: bool) -> None:
        """Once every node is stopped: wait until the pods are gone, then delete the token
        Secret and close the watches."""
        if not everything or self._core is None:
            return
        self._await_gone(nodes, self.options.stop_grace + _GONE_WAIT)
        self._delete_secret()
        self._disconnect()

    # -- the cluster --------------------------------------------------------------------

    def _connect(self, spec: LaunchSpec) -> None:
        from kubernetes import client

        self._spec = spec
        if self._core is not None:
            return
        self._client = api.connect(self.options)
        self._core = client.CoreV1Api(self._client)
        self._namespace = api.namespace(self.options)
        try:
            self._owner_ref = self._find_owner()
        except BaseException:
            self._disconnect()
            raise
        timeout = self.options.request_timeout
        self._pods_informer = Informer(
            "pods",
            lambda **kw: self._core.list_namespaced_pod(self._namespace, **kw),
            self._pod_changed,
            selector=pods.run_selector(spec.run_id or spec.job),
            request_timeout=timeout,
        )
        nodes = Informer("nodes", self._core.list_node, self._node_changed, request_timeout=timeout)
        self._informers = [self._pods_informer, nodes]
        for informer in self._informers:
            informer.start()
        deadline = time.monotonic() + timeout
        for informer in self._informers:
            if not informer.synced.wait(max(0.0, deadline - time.monotonic())):
                error = informer.error or "no answer"
                self._disconnect()
                raise SchedulerError(
                    f"cannot list the {informer.what} of namespace {self._namespace!r} within "
                    f"{timeout:g}s: {error}"
                )

    def _disconnect(self) -> None:
        for informer in self._informers:
            informer.stop()
        self._informers = []
        if self._client is not None:
            self._client.close()
        self._client = self._core = None

    def _find_owner(self) -> OwnerRef | None:
        owner = self.options.owner
        if isinstance(owner, OwnerRef):
            return owner
        pod_name = os.environ.get(api.POD_NAME_ENV)
        if owner == "none" or not pod_name:
            return None
        try:
            me = self._core.read_namespaced_pod(
                pod_name, self._namespace, _request_timeout=self.options.request_timeout
            )
        except Exception as exc:
            raise api.error(f"cannot read the master's own pod {pod_name}", exc) from exc
        return OwnerRef(api_version="v1", kind="Pod", name=pod_name, uid=me.metadata.uid)

    def _ensure_secret(self, spec: LaunchSpec) -> None:
        if self._secret_made:
            return
        body = pods.secret(spec, self._owner_ref)
        try:
            made = self._core.create_namespaced_secret(
                self._namespace, body, _request_timeout=self.options.request_timeout
            )
        except Exception as exc:
            raise api.error(f"cannot create the Secret {body.metadata.name}", exc) from exc
        self._secret_made = True
        if self._owner_ref is None:  # the pods belong to the Secret: one delete ends the job
            self._pods_owner = OwnerRef(
                api_version="v1", kind="Secret", name=body.metadata.name, uid=made.metadata.uid
            )

    def _delete_secret(self) -> None:
        if not self._secret_made or self._spec is None or self._core is None:
            return
        name = pods.secret_name(self._spec)
        try:
            self._core.delete_namespaced_secret(
                name, self._namespace, _request_timeout=self.options.request_timeout
            )
        except Exception as exc:
            code, said = api.status_of(exc)
            if code != 404:
                log.warning("cannot delete the token Secret", secret=name, error=said)
        self._secret_made = False

    def _cordon(self, host: str) -> None:
        try:
            from kubernetes import client

            self._core.patch_node(
                host,
                client.V1Node(spec=client.V1NodeSpec(unschedulable=True)),
                _request_timeout=self.options.request_timeout,
            )
            log.warning("kubernetes node cordoned", k8s_node=host)
        except Exception as exc:
            _, said = api.status_of(exc)
            log.warning("cannot cordon the kubernetes node", k8s_node=host, error=said)

    # -- pods -------------------------------------------------------------------------------

    def _new_pod(self, node: _K8sNode) -> _Pod:
        """A record for the node's pod, which the watches fill in from now on."""
        record = _Pod(pods.pod_name(node.spec, node.node_id))
        with self._lock:
            self._by_pod[record.name] = record
        return record

    def _placed(self, handle: NodeHandle) -> NodeHandle:
        """``handle`` as its node is now: where Kubernetes bound it (``pending`` until it
        did), with that Kubernetes node's topology, and whether it runs."""
        node = self.node(handle.node_id)
        with self._lock:
            pod = node.data
            if pod is not None:
                node.host = pod.host or node.host
            running = pod is not None and pod.running
        state = NodeState.RUNNING if running else NodeState.PENDING
        return handle.model_copy(
            update={
                "host": node.host or "pending",
                "state": state,
                "topology": self.handle_topology(node),
            }
        )

    def _hostnames(self, hosts: Iterable[str]) -> list[str]:
        """The ``kubernetes.io/hostname`` labels (names, for a node without one) of ``hosts``."""
        with self._lock:
            found = []
            for host in set(hosts):
                labels = self._cluster_nodes.get(host, {}).get("metadata", {}).get("labels") or {}
                found.append(labels.get(pods.HOSTNAME, host))
            return found

    def _create(self, nodes: list[_K8sNode], avoid: Iterable[str] = ()) -> None:
        """Create the nodes' pods, ``parallelism`` at once, each kept off the hosts its node
        avoids and off ``avoid``. A refusal raises, naming the pod and the API server's
        reason (the caller deletes the ones made)."""
        extra = {}
        marker = os.environ.get(leftovers.VARIABLE)
        if marker:  # what the job starts on the cluster carries the run's marker
            extra[leftovers.VARIABLE] = marker
        if tag := os.environ.get(TAG_ENV):  # and names its files in /dev/shm as the run does
            extra[TAG_ENV] = tag
        owner = self._owner_ref or self._pods_owner
        more = list(avoid)
        bodies = [
            pods.pod(
                n.spec,
                self.options,
                n.node_id,
                owner=owner,
                excluded=self._hostnames([*n.avoid, *more]),
                extra_env=extra,
            )
            for n in nodes
        ]
        timeout = self.options.request_timeout

        def create(body: Any) -> BaseException | None:
            if self.interrupted:
                return SchedulerError("the job is stopping (the scheduler was interrupted)")
            try:
                self._core.create_namespaced_pod(self._namespace, body, _request_timeout=timeout)
            except Exception as exc:
                return exc
            return None

        workers = min(self.options.parallelism, len(bodies))
        with ThreadPoolExecutor(workers, thread_name_prefix="create-pod") as pool:
            results = list(pool.map(create, bodies))
        failures = []
        with self._lock:
            for node, failed in zip(nodes, results, strict=True):
                assert node.data is not None
                if failed is None:
                    node.data.created = True
                else:
                    failures.append((node.data.name, failed))
        if failures:
            name, exc = failures[0]
            more_failed = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
            if isinstance(exc, SchedulerError):
                raise exc
            raise api.error(f"cannot create pod {name}{more_failed}", exc) from exc
        log.info("pods created", count=len(nodes), namespace=self._namespace)

    def _await(self, nodes: list[_K8sNode], *, running: bool, quick: bool = False) -> bool:
        """Wait until each node runs (``running``) or is scheduled; raise when one cannot be
        (see :meth:`_cannot_start`) or the job stops. With ``quick``, False as soon as one is
        found unschedulable."""
        with self._lock:
            while True:
                records = [n.data for n in nodes if n.data is not None]
                if quick and any(p.unschedulable for p in records):
                    return False
                if self.interrupted:
                    raise SchedulerError("the job is stopping (the scheduler was interrupted)")
                for pod in records:
                    why = self._cannot_start(pod, time.monotonic())
                    if why:
                        raise SchedulerError(why)
                if all(p.settled or (not running and p.host) for p in records):
                    return True
                self._changed.wait(0.2)

    def _cannot_start(self, pod: _Pod, now: float) -> str:
        if pod.settled:
            return ""
        if (
            pod.unschedulable_since is not None
            and now - pod.unschedulable_since > self.options.schedule_timeout
        ):
            return (
                f"pod {pod.name} could not be scheduled for "
                f"{self.options.schedule_timeout:g}s: {pod.unschedulable}"
            )
        if pod.waiting_since is not None and now - pod.waiting_since > self.options.start_timeout:
            within = f"{self.options.start_timeout:g}s"
            return f"pod {pod.name} did not start within {within}: {pod.waiting}"
        return ""

    def _await_gone(self, nodes: Iterable[_K8sNode], timeout: float) -> None:
        """Wait until the nodes' pods are gone, at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._lock:
            records = [n.data for n in nodes if n.data is not None]
            while any(not p.gone for p in records) and time.monotonic() < deadline:
                self._changed.wait(0.2)
            left = [p.name for p in records if not p.gone]
        if left:
            log.warning("pods still terminating", pods=left)

    def _delete(self, nodes: Iterable[_K8sNode], grace: float) -> None:
        """Delete the nodes' pods (``grace``), once each; a pod gone already, or never
        created, is no error."""
        with self._lock:
            targets = []
            for node in nodes:
                pod = node.data
                if pod is None or pod.deleting or pod.gone:
                    continue
                pod.deleting = True
                if pod.created:
                    targets.append((node.node_id, pod))
                else:
                    pod.gone = True
        if not targets or self._core is None:
            return
        seconds = round(grace)
        timeout = self.options.request_timeout

        def delete(target: tuple[str, _Pod]) -> None:
            node_id, pod = target
            try:
                self._core.delete_namespaced_pod(
                    pod.name,
                    self._namespace,
                    grace_period_seconds=seconds,
                    propagation_policy="Background",
                    _request_timeout=timeout,
                )
            except Exception as exc:
                code, said = api.status_of(exc)
                if code == 404:
                    with self._lock:
                        pod.gone = True
                else:
                    log.warning("cannot delete pod", pod=pod.name, error=said)
            log.info("node stopped", node=node_id, pod=pod.name)

        workers = min(self.options.parallelism, len(targets))
        with ThreadPoolExecutor(workers, thread_name_prefix="delete-pod") as pool:
            list(pool.map(delete, targets))

    # -- what the watches see (on the informers' threads) -----------------------------------

    def _pod_changed(
        self, name: str, before: dict[str, Any] | None, after: dict[str, Any] | None
    ) -> None:
        with self._lock:
            pod = self._by_pod.get(name)
            if pod is not None:
                if after is None:
                    pod.gone = True
                    if not pod.deleting and pod.end is None:
                        pod.end = (NodeState.LOST, f"its pod {name} was deleted")
                else:
                    self._observe_pod(pod, after)
            self._seen = True
            self._changed.notify_all()

    def _observe_pod(self, pod: _Pod, seen: dict[str, Any]) -> None:
        pod.host = seen.get("spec", {}).get("nodeName") or pod.host
        if pod.end is not None:
            return
        status = seen.get("status", {})
        if status.get("reason") == "Evicted":
            pod.end = (NodeState.LOST, f"pod {pod.name} was evicted: {status.get('message')}")
            return
        if seen["metadata"].get("deletionTimestamp"):
            if not pod.deleting:
                pod.end = (NodeState.LOST, f"pod {pod.name} is being deleted (not by the job)")
            return
        phase = status.get("phase")
        if phase in ("Succeeded", "Failed"):
            pod.end = _exit(seen)
            return
        if pod.host:
            ready, why = _ready(self._cluster_nodes.get(pod.host, {"status": {}}))
            if pod.host in self._cluster_nodes and not ready:
                pod.end = (NodeState.LOST, f"its Kubernetes node {pod.host} is NotReady: {why}")
                return
        now = time.monotonic()
        unschedulable = "" if pod.host else _unschedulable(seen)
        if unschedulable and pod.unschedulable_since is None:
            pod.unschedulable_since = now
        pod.unschedulable = unschedulable
        if not unschedulable:
            pod.unschedulable_since = None
        waiting = _waiting(seen)
        if waiting and pod.waiting_since is None:
            pod.waiting_since = now
        pod.waiting = waiting
        if not waiting:
            pod.waiting_since = None
        if phase == "Running" and any(
            (s.get("state") or {}).get("running") for s in status.get("containerStatuses") or []
        ):
            pod.running = True

    def _node_changed(
        self, name: str, before: dict[str, Any] | None, after: dict[str, Any] | None
    ) -> None:
        with self._lock:
            if after is None:
                self._cluster_nodes.pop(name, None)
                ready, why = False, "it was removed from the cluster"
            else:
                self._cluster_nodes[name] = after
                ready, why = _ready(after)
            if not ready:
                for pod in self._by_pod.values():
                    if pod.host == name and pod.end is None and not pod.deleting:
                        pod.end = (NodeState.LOST, f"its Kubernetes node {name} is NotReady: {why}")
            self._seen = True
            self._changed.notify_all()
