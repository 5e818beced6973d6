"""The emulated scheduler: binds pending pods to fitting nodes, or says why none fits.

A node fits a pod when, checked in the real scheduler's filter order (the first failing check is
the node's reason, as there): it is not ``spec.unschedulable``; the pod tolerates its
``NoSchedule``/``NoExecute`` taints (a node that is not Ready carries the real
``node.kubernetes.io/unreachable`` or ``not-ready`` taint); it matches ``spec.nodeSelector``
and the required node affinity (``In``, ``NotIn``, ``Exists``, ``DoesNotExist``, ``Gt``,
``Lt``; ``matchFields`` on ``metadata.name``); its allocatable ``cpu``, ``memory``, ``pods``
and extended resources cover the pod's requests (a limit without a request counts as the
request) on top of the non-terminal pods already bound there; and no required pod anti-affinity
term, of the pod or of a pod on the node, is violated (only ``topologyKey:
kubernetes.io/hostname``, within the pod's namespace unless the term names ``namespaces``).

Among fitting nodes it picks the one with the fewest bound non-terminal pods, then by name. When
none fits, the pod gets ``PodScheduled False/Unschedulable`` with the real message format
(``0/3 nodes are available: 1 node(s) didn't match pod anti-affinity rules, 2 Insufficient
nvidia.com/gpu.``) and a ``FailedScheduling`` event, each time the message changes. Preemption,
preferred (soft) terms, pod affinity (as opposed to anti-affinity), topology spread constraints
and ports are not emulated.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from planaria_kubernetes.testing import semantics
from planaria_kubernetes.testing.apiserver import Store
from planaria_kubernetes.testing.semantics import Obj

HOSTNAME = "kubernetes.io/hostname"
NODE_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def is_terminal(pod: Obj) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def node_ready(node: Obj) -> bool:
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


def pod_requests(pod: Obj) -> dict[str, Fraction]:
    """The sum of the containers' requests (a limit without a request counts as the request)."""
    total: dict[str, Fraction] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        wanted: dict[str, Any] = dict(resources.get("limits") or {})
        wanted.update(resources.get("requests") or {})
        for name, value in wanted.items():
            total[name] = total.get(name, Fraction(0)) + semantics.parse_quantity(value)
    return total


def _tolerates(tolerations: list[Obj], taint: Mapping[str, Any]) -> bool:
    for toleration in tolerations:
        effect = toleration.get("effect")
        if effect and effect != taint.get("effect"):
            continue
        key = toleration.get("key")
        operator = toleration.get("operator") or "Equal"
        if not key and operator == "Exists":
            return True
        if key != taint.get("key"):
            continue
        if operator == "Exists" or (toleration.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _node_affinity_matches(pod: Obj, node: Obj) -> bool:
    spec = pod.get("spec") or {}
    labels: dict[str, str] = node["metadata"].get("labels") or {}
    for key, value in (spec.get("nodeSelector") or {}).items():
        if labels.get(key) != value:
            return False
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms")
    if not terms:
        return True
    for term in terms:
        requirements = [
            semantics.Requirement(e["key"], e["operator"], tuple(e.get("values") or ()))
            for e in term.get("matchExpressions") or []
        ]
        fields = [
            semantics.Requirement(e["key"], e["operator"], tuple(e.get("values") or ()))
            for e in term.get("matchFields") or []
        ]
        if not requirements and not fields:
            continue  # an empty term matches nothing
        if semantics.labels_match(requirements, labels) and semantics.labels_match(
            fields, {"metadata.name": node["metadata"]["name"]}
        ):
            return True
    return False


def _anti_affinity_terms(pod: Obj) -> list[Obj]:
    affinity = (pod.get("spec") or {}).get("affinity") or {}
    terms = (affinity.get("podAntiAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    return list(terms or [])


def _term_selects(term: Obj, owner: Obj, other: Obj) -> bool:
    """Whether an anti-affinity term of ``owner`` selects ``other`` (hostname topology only)."""
    if term.get("topologyKey") != HOSTNAME:
        return False
    namespaces = term.get("namespaces") or [owner["metadata"].get("namespace")]
    if other["metadata"].get("namespace") not in namespaces:
        return False
    requirements = semantics.selector_from_spec(term.get("labelSelector"))
    if requirements is None:
        return False
    return semantics.labels_match(requirements, other["metadata"].get("labels"))


class Scheduler:
    """Binds pending pods; runs in the API server's event loop, on its :class:`Store`."""

    def __init__(self, store: Store, interval: float = 0.5) -> None:
        self.store = store
        self.interval = interval
        self.wakeup = asyncio.Event()
        store.listeners.append(self.wakeup)

    async def run(self) -> None:
        while True:
            try:
                self.schedule_once()
            except Exception:
                self.store.report("the scheduler")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wakeup.wait(), self.interval)
            self.wakeup.clear()

    def schedule_once(self) -> None:
        pods = self.store.all("pods")
        pending = [
            pod
            for pod in pods
            if not (pod.get("spec") or {}).get("nodeName")
            and not pod["metadata"].get("deletionTimestamp")
            and not is_terminal(pod)
            and (pod.get("spec") or {}).get("schedulerName", "default-scheduler")
            == "default-scheduler"
        ]
        if not pending:
            return
        pending.sort(key=lambda pod: int(pod["metadata"]["resourceVersion"]))
        # The nodes and what runs on each, once per pass: a pass over many pending pods
        # stays linear in them.
        nodes = self.store.all("nodes")
        on_nodes: dict[str, list[Obj]] = {}
        for other in pods:
            where = (other.get("spec") or {}).get("nodeName")
            if where and not is_terminal(other):
                on_nodes.setdefault(where, []).append(other)
        for pod in pending:
            self._schedule(pod, nodes, on_nodes)

    def _schedule(self, pod: Obj, nodes: list[Obj], on_nodes: dict[str, list[Obj]]) -> None:
        fitting: list[tuple[int, str]] = []
        reasons: Counter[str] = Counter()
        for node in nodes:
            name = node["metadata"]["name"]
            on_node = on_nodes.get(name, [])
            failures = self._check(pod, node, on_node)
            if failures:
                reasons.update(failures)
            else:
                fitting.append((len(on_node), name))
        meta = pod["metadata"]
        if fitting:
            target = min(fitting)[1]

            def bind(obj: Obj) -> None:
                obj.setdefault("spec", {})["nodeName"] = target
                self._set_condition(obj, "True", None, None)

            bound = self.store.mutate("pods", meta.get("namespace"), meta["name"], bind)
            if bound is not None:
                on_nodes.setdefault(target, []).append(bound)
            self._event(
                pod,
                "Normal",
                "Scheduled",
                f"Successfully assigned {meta.get('namespace')}/{meta['name']} to {target}",
            )
            return
        details = sorted(f"{count} {reason}" for reason, count in reasons.items())
        message = f"0/{len(nodes)} nodes are available"
        message += (": " + ", ".join(details) + ".") if details else "."
        current = [
            c
            for c in (pod.get("status") or {}).get("conditions") or []
            if c.get("type") == "PodScheduled"
        ]
        if current and current[0].get("message") == message:
            return

        def refuse(obj: Obj) -> None:
            self._set_condition(obj, "False", "Unschedulable", message)

        self.store.mutate("pods", meta.get("namespace"), meta["name"], refuse)
        self._event(pod, "Warning", "FailedScheduling", message)

    def _check(self, pod: Obj, node: Obj, on_node: list[Obj]) -> list[str]:
        spec = node.get("spec") or {}
        if spec.get("unschedulable"):
            return ["node(s) were unschedulable"]
        tolerations = (pod.get("spec") or {}).get("tolerations") or []
        taints = list(spec.get("taints") or [])
        if not node_ready(node) and not any(t.get("key") in NODE_TAINTS for t in taints):
            # A node made not Ready by hand rather than by set_node_ready: the controller's taint.
            taints.append({"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"})
        for taint in taints:
            if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(
                tolerations, taint
            ):
                key, value = taint.get("key"), taint.get("value", "")
                return [f"node(s) had untolerated taint {{{key}: {value}}}"]
        if not _node_affinity_matches(pod, node):
            return ["node(s) didn't match Pod's node affinity/selector"]
        allocatable = {
            key: semantics.parse_quantity(value)
            for key, value in ((node.get("status") or {}).get("allocatable") or {}).items()
        }
        used: dict[str, Fraction] = {}
        for other in on_node:
            for key, value in pod_requests(other).items():
                used[key] = used.get(key, Fraction(0)) + value
        insufficient: list[str] = []
        if "pods" in allocatable and len(on_node) + 1 > allocatable["pods"]:
            insufficient.append("Too many pods")
        for key, value in sorted(pod_requests(pod).items()):
            if value > 0 and used.get(key, Fraction(0)) + value > allocatable.get(key, Fraction(0)):
                insufficient.append(f"Insufficient {key}")
        if insufficient:
            return insufficient
        live = [other for other in on_node if not other["metadata"].get("deletionTimestamp")]
        for term in _anti_affinity_terms(pod):
            if any(_term_selects(term, pod, other) for other in live):
                return ["node(s) didn't match pod anti-affinity rules"]
        for other in live:
            if any(_term_selects(term, other, pod) for term in _anti_affinity_terms(other)):
                return ["node(s) didn't match pod anti-affinity rules"]
        return []

    @staticmethod
    def _set_condition(pod: Obj, status: str, reason: str | None, message: str | None) -> None:
        conditions: list[Obj] = pod.setdefault("status", {}).setdefault("conditions", [])
        condition: Obj = {
            "type": "PodScheduled",
            "status": status,
            "lastProbeTime": None,
            "lastTransitionTime": semantics.timestamp(),
        }
        if reason:
            condition["reason"] = reason
        if message:
            condition["message"] = message
        conditions[:] = [c for c in conditions if c.get("type") != "PodScheduled"] + [condition]

    def _event(self, pod: Obj, kind: str, reason: str, message: str) -> None:
        meta = pod["metadata"]
        namespace = meta.get("namespace") or "default"
        if self.store.find("namespaces", None, namespace) is None:
            return
        self.store.create(
            "events",
            namespace,
            {
                "metadata": {"generateName": f"{meta['name']}."},
                "involvedObject": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "namespace": namespace,
                    "name": meta["name"],
                    "uid": meta.get("uid"),
                },
                "reason": reason,
                "message": message,
                "type": kind,
                "source": {"component": "default-scheduler"},
                "firstTimestamp": semantics.timestamp(),
                "lastTimestamp": semantics.timestamp(),
                "count": 1,
                "reportingComponent": "default-scheduler",
            },
        )
