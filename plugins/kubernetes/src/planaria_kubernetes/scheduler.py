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
- **Ownership.** Every pod has an owner reference: to the master's own pod when it runs in one
  (deleting the master deletes the job), to a configured owner, or else to the token Secret.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from planaria import leftovers
from planaria.errors import ConfigIssue
from planaria.log import get_logger
from planaria.plugin import (
    LaunchSpec,
    NodeEvent,
    NodeHandle,
    NodeState,
    Scheduler,
    SchedulerError,
    poll_events,
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
class _Node:
    node_id: str
    pod: str
    host: str = ""
    """The Kubernetes node the pod is bound to; empty until it is scheduled."""
    since: float = field(default_factory=time.monotonic)
    running: bool = False
    reported: bool = False
    """Its end was reported: nothing more of it is."""
    released: bool = False
    """Stopped or replaced by the master: its end is no news."""
    unschedulable: str = ""
    unschedulable_since: float | None = None
    waiting: str = ""
    waiting_since: float | None = None
    gone: bool = False

    @property
    def settled(self) -> bool:
        return self.running or self.reported or self.released


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


def _ready(node: dict[str, Any]) -> tuple[bool, str]:
    for condition in node.get("status", {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            why = f"{condition.get('reason') or ''}: {condition.get('message') or ''}".strip(": ")
            return condition.get("status") == "True", why
    return False, "it has no Ready condition"


class KubernetesScheduler(Scheduler[KubernetesOptions]):
    """Nodes are pods (see the module docstring)."""

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
        self._nodes: dict[str, _Node] = {}
        self._by_pod: dict[str, _Node] = {}
        self._events: list[NodeEvent] = []
        self._excluded: dict[str, str] = {}
        self._next_number = 0
        self._client: Any = None
        self._core: Any = None
        self._namespace = ""
        self._spec: LaunchSpec | None = None
        self._owner: OwnerRef | None = None
        self._secret_made = False
        self._pods_owner: OwnerRef | None = None
        """Without an owner: the token Secret, made first, owns the pods."""
        self._informers: list[Informer] = []
        self._pods_informer: Informer | None = None
        self._cluster_nodes: dict[str, dict[str, Any]] = {}

    # -- the Scheduler interface --------------------------------------------------------

    def launch(self, spec: LaunchSpec, count: int) -> list[NodeHandle]:
        """Create ``count`` pods and wait until they run (see the module docstring)."""
        if count < 0:
            raise SchedulerError(f"cannot launch {count} nodes: the count must be 0 or more")
        if not spec.command:
            raise SchedulerError("cannot launch nodes: the launch command is empty")
        if count == 0:
            return []
        self.check_interrupted("cannot launch nodes")
        self._connect(spec)
        self._ensure_secret(spec)
        with self._lock:
            nodes = [self._new_node(spec) for _ in range(count)]
        try:
            self._create(spec, nodes)
            self._await(nodes, running=True)
        except BaseException:
            self._delete(nodes)
            with self._lock:
                others = [n for n in self._nodes.values() if not n.released]
            if not others:  # nothing of the job may be left: its Secret neither
                self.stop()
            raise
        return [self._handle(n) for n in nodes]

    def poll(self, timeout: float) -> list[NodeEvent]:
        """State changes since the last call; waits at most ``timeout`` for the first."""
        return poll_events(timeout, self._take, self._sleep)

    def replace(self, node_id: str, *, exclude_host: bool) -> NodeHandle:
        """Delete ``node_id``'s pod and create its successor, kept off every excluded host
        and, while another node can take it, off the old one's; returns once the new pod is
        scheduled."""
        self.check_interrupted(f"cannot replace {node_id}")
        old = self._get(node_id)
        if old.released:
            raise SchedulerError(f"cannot replace {node_id}: it was already stopped or replaced")
        if exclude_host and old.host:
            self._exclude(old.host, f"node {node_id} was diagnosed faulty")
        self._delete([old])
        assert self._spec is not None
        avoid = [old.host] if old.host and not exclude_host else []
        try:
            new = self._place(self._spec, avoid)
            if new is None:  # no other node: the old one's host, when it is not excluded
                new = self._place(self._spec, [])
            assert new is not None
        except SchedulerError as exc:
            raise SchedulerError(f"cannot replace {node_id}: {exc}") from exc
        log.info("node replaced", node=node_id, replacement=new.node_id, k8s_node=new.host)
        return self._handle(new)

    def _place(self, spec: LaunchSpec, avoid: list[str]) -> _Node | None:
        """A new node's pod, scheduled; with ``avoid``, None as soon as Kubernetes finds no
        node but those for it (its pod deleted again)."""
        with self._lock:
            new = self._new_node(spec)
        self._create(spec, [new], avoid)
        try:
            placed = self._await([new], running=False, quick=bool(avoid))
        except BaseException:
            self._delete([new])
            raise
        if not placed:
            self._delete([new])
            return None
        return new

    def stop(self, node_ids: list[str] | None = None) -> None:
        """Delete the pods (their agents get SIGTERM, SIGKILL after ``stop_grace``). Stopping
        every node waits until the pods are gone and deletes the token Secret."""
        with self._lock:
            if node_ids is None:
                targets = list(self._nodes.values())
            else:
                targets = [self._get(node_id) for node_id in dict.fromkeys(node_ids)]
        self._delete(targets)
        if node_ids is not None or self._core is None:
            return
        deadline = time.monotonic() + self.options.stop_grace + _GONE_WAIT
        with self._lock:
            while any(not n.gone for n in targets) and time.monotonic() < deadline:
                self._changed.wait(0.2)
            left = [n.pod for n in targets if not n.gone]
        if left:
            log.warning("pods still terminating", pods=left)
        self._delete_secret()
        self._disconnect()

    def adopt(self, spec: LaunchSpec, handles: list[NodeHandle], excluded: set[str]) -> None:
        """Find a restarted master's pods again by name; one that is gone is reported lost."""
        self._connect(spec)
        self._secret_made = True  # the earlier master made it; the job still needs it
        if self._owner is None:  # then the Secret owns the pods: so it does the new ones
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
        stale = []
        with self._lock:
            for host in excluded:
                self._excluded.setdefault(host, "excluded by an earlier master")
            for handle in handles:
                number = handle.node_id.removeprefix("node-")
                if number.isdigit():
                    self._next_number = max(self._next_number, int(number) + 1)
                node = _Node(handle.node_id, pods.pod_name(spec, handle.node_id), host=handle.host)
                self._nodes[node.node_id] = node
                self._by_pod[node.pod] = node
                assert self._pods_informer is not None
                current = self._pods_informer.objects.get(node.pod)
                if handle.state is NodeState.LOST:  # out of the job: its pod must go
                    node.reported = True
                    node.gone = current is None
                    if current is not None:
                        stale.append(node)
                    continue
                if current is None:
                    node.gone = True
                    self._report(node, NodeState.LOST, f"its pod {node.pod} is gone")
                else:
                    self._observe(node, current)
                    log.info("node adopted", node=node.node_id, pod=node.pod)
        self._delete(stale)

    def excluded_hosts(self) -> set[str]:
        with self._lock:
            return set(self._excluded)

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
            self._owner = self._find_owner()
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
        body = pods.secret(spec, self._owner)
        try:
            made = self._core.create_namespaced_secret(
                self._namespace, body, _request_timeout=self.options.request_timeout
            )
        except Exception as exc:
            raise api.error(f"cannot create the Secret {body.metadata.name}", exc) from exc
        self._secret_made = True
        if self._owner is None:  # the pods belong to the Secret: one delete ends the job
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

    def _exclude(self, host: str, why: str) -> None:
        with self._lock:
            if host in self._excluded:
                return
            self._excluded[host] = why
        log.warning("kubernetes node excluded", k8s_node=host, why=why)
        if self.options.cordon:
            self._cordon(host)

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

    def _new_node(self, spec: LaunchSpec) -> _Node:
        node_id = f"node-{self._next_number}"
        self._next_number += 1
        node = _Node(node_id, pods.pod_name(spec, node_id))
        self._nodes[node_id] = node
        self._by_pod[node.pod] = node
        return node

    def _get(self, node_id: str) -> _Node:
        node = self._nodes.get(node_id)
        if node is None:
            raise SchedulerError(
                f"unknown node {node_id!r}: this kubernetes scheduler never started it"
            )
        return node

    def _handle(self, node: _Node) -> NodeHandle:
        return NodeHandle(
            node_id=node.node_id,
            host=node.host or "pending",
            state=NodeState.RUNNING if node.running else NodeState.PENDING,
            data={"pod": node.pod, "namespace": self._namespace},
        )

    def _hostnames(self, more: Iterable[str] = ()) -> list[str]:
        """The ``kubernetes.io/hostname`` labels (names, for a node without one) of the
        excluded nodes and of ``more``."""
        with self._lock:
            found = []
            for host in {*self._excluded, *more}:
                labels = self._cluster_nodes.get(host, {}).get("metadata", {}).get("labels") or {}
                found.append(labels.get(pods.HOSTNAME, host))
            return found

    def _create(
        self, spec: LaunchSpec, nodes: list[_Node], avoid: Iterable[str] = ()
    ) -> list[_Node]:
        """Create the nodes' pods, ``parallelism`` at once. A refusal deletes the ones made and
        raises, naming the pod and the API server's reason."""
        extra = {}
        marker = os.environ.get(leftovers.VARIABLE)
        if marker:  # what the job starts on the cluster carries the run's marker
            extra[leftovers.VARIABLE] = marker
        if tag := os.environ.get(TAG_ENV):  # and names its files in /dev/shm as the run does
            extra[TAG_ENV] = tag
        owner = self._owner or self._pods_owner
        excluded = self._hostnames(avoid)
        bodies = [
            pods.pod(spec, self.options, n.node_id, owner=owner, excluded=excluded, extra_env=extra)
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
        made = [n for n, failed in zip(nodes, results, strict=True) if failed is None]
        failures = [
            (n, failed) for n, failed in zip(nodes, results, strict=True) if failed is not None
        ]
        if failures:
            node, exc = failures[0]
            self._delete(made)
            with self._lock:
                for n, _ in failures:
                    n.released = n.gone = True
            more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
            if isinstance(exc, SchedulerError):
                raise exc
            raise api.error(f"cannot create pod {node.pod}{more}", exc) from exc
        log.info("pods created", count=len(made), namespace=self._namespace)
        return made

    def _await(self, nodes: list[_Node], *, running: bool, quick: bool = False) -> bool:
        """Wait until each node runs (``running``) or is scheduled; raise when one cannot be
        (see :meth:`_cannot_start`) or the job stops. With ``quick``, False as soon as one is
        found unschedulable."""
        with self._lock:
            while True:
                if quick and any(n.unschedulable for n in nodes):
                    return False
                if self.interrupted:
                    raise SchedulerError("the job is stopping (the scheduler was interrupted)")
                for node in nodes:
                    why = self._cannot_start(node, time.monotonic())
                    if why:
                        raise SchedulerError(why)
                if all(n.settled or (not running and n.host) for n in nodes):
                    return True
                self._changed.wait(0.2)

    def _cannot_start(self, node: _Node, now: float) -> str:
        if node.settled:
            return ""
        if (
            node.unschedulable_since is not None
            and now - node.unschedulable_since > self.options.schedule_timeout
        ):
            return (
                f"pod {node.pod} could not be scheduled for "
                f"{self.options.schedule_timeout:g}s: {node.unschedulable}"
            )
        if node.waiting_since is not None and now - node.waiting_since > self.options.start_timeout:
            within = f"{self.options.start_timeout:g}s"
            return f"pod {node.pod} did not start within {within}: {node.waiting}"
        return ""

    def _delete(self, nodes: Iterable[_Node]) -> None:
        """Release the nodes and delete their pods (``stop_grace``); a pod gone already is
        no error."""
        with self._lock:
            targets = []
            for node in nodes:
                if not node.released:
                    node.released = True
                    targets.append(node)
            ids = {n.node_id for n in targets}
            self._events = [e for e in self._events if e.node_id not in ids]
        if not targets or self._core is None:
            return
        grace = round(self.options.stop_grace)
        timeout = self.options.request_timeout

        def delete(node: _Node) -> None:
            try:
                self._core.delete_namespaced_pod(
                    node.pod,
                    self._namespace,
                    grace_period_seconds=grace,
                    propagation_policy="Background",
                    _request_timeout=timeout,
                )
            except Exception as exc:
                code, said = api.status_of(exc)
                if code == 404:
                    with self._lock:
                        node.gone = True
                else:
                    log.warning("cannot delete pod", pod=node.pod, error=said)
            log.info("node stopped", node=node.node_id, pod=node.pod)

        workers = min(self.options.parallelism, len(targets))
        with ThreadPoolExecutor(workers, thread_name_prefix="delete-pod") as pool:
            list(pool.map(delete, targets))

    # -- what the watches see ---------------------------------------------------------------

    def _pod_changed(
        self, name: str, before: dict[str, Any] | None, after: dict[str, Any] | None
    ) -> None:
        with self._lock:
            node = self._by_pod.get(name)
            if node is not None:
                if after is None:
                    node.gone = True
                    if not node.released:
                        self._report(node, NodeState.LOST, f"its pod {name} was deleted")
                else:
                    self._observe(node, after)
            self._changed.notify_all()

    def _observe(self, node: _Node, pod: dict[str, Any]) -> None:
        node.host = pod.get("spec", {}).get("nodeName") or node.host
        if node.released or node.reported:
            return
        status = pod.get("status", {})
        if status.get("reason") == "Evicted":
            self._report(
                node, NodeState.LOST, f"pod {node.pod} was evicted: {status.get('message')}"
            )
            return
        if pod["metadata"].get("deletionTimestamp"):
            self._report(node, NodeState.LOST, f"pod {node.pod} is being deleted (not by the job)")
            return
        phase = status.get("phase")
        if phase in ("Succeeded", "Failed"):
            state, why = _exit(pod)
            self._report(node, state, why)
            return
        if node.host:
            ready, why = _ready(self._cluster_nodes.get(node.host, {"status": {}}))
            if node.host in self._cluster_nodes and not ready:
                self._report(
                    node, NodeState.LOST, f"its Kubernetes node {node.host} is NotReady: {why}"
                )
                return
        now = time.monotonic()
        unschedulable = "" if node.host else _unschedulable(pod)
        if unschedulable and node.unschedulable_since is None:
            node.unschedulable_since = now
        node.unschedulable = unschedulable
        if not unschedulable:
            node.unschedulable_since = None
        waiting = _waiting(pod)
        if waiting and node.waiting_since is None:
            node.waiting_since = now
        node.waiting = waiting
        if not waiting:
            node.waiting_since = None
        running = phase == "Running" and any(
            (s.get("state") or {}).get("running") for s in status.get("containerStatuses") or []
        )
        if running and not node.running:
            node.running = True
            self._events.append(NodeEvent(node_id=node.node_id, state=NodeState.RUNNING))
            log.info("node running", node=node.node_id, pod=node.pod, k8s_node=node.host)

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
                for node in self._nodes.values():
                    if node.host == name and not node.released and not node.reported:
                        self._report(
                            node, NodeState.LOST, f"its Kubernetes node {name} is NotReady: {why}"
                        )
            self._changed.notify_all()

    def _report(self, node: _Node, state: NodeState, reason: str) -> None:
        node.reported = True
        self._events.append(NodeEvent(node_id=node.node_id, state=state, reason=reason))
        log.info("node ended", node=node.node_id, state=state.value, reason=reason)

    def _take(self) -> list[NodeEvent]:
        with self._lock:
            now = time.monotonic()
            stuck = []
            for node in self._nodes.values():
                why = self._cannot_start(node, now)
                if why:
                    self._report(node, NodeState.FAILED, why)
                    stuck.append(node)
            events, self._events = self._events, []
        if stuck:  # what cannot start must not hold a node's resources, or wait for ever
            self._delete(stuck)
        return events

    def _sleep(self, remaining: float) -> None:
        with self._lock:
            if not self._events:
                self._changed.wait(min(remaining, 0.5))
