"""What the emulated kubelet reads from a pod object and writes back to it, in the API's own
shapes: ``$(VAR)`` expanded in a command as the real kubelet expands it, a ``fieldRef``'s value,
a container's status and the pod's conditions."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from planaria_kubernetes.testing import semantics
from planaria_kubernetes.testing.semantics import Obj

_VAR = re.compile(r"\$\$|\$\(([-._A-Za-z0-9]+)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """``$(VAR)`` -> its value when defined, ``$$`` -> ``$``, as the kubelet expands."""

    def one(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        return env.get(match[1], match[0])

    return _VAR.sub(one, text)


def field_value(pod: Obj, path: str, address: str) -> str | None:
    meta = pod["metadata"]
    values: dict[str, Any] = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": (pod.get("spec") or {}).get("nodeName"),
        "spec.serviceAccountName": (pod.get("spec") or {}).get("serviceAccountName"),
        "status.podIP": address,
        "status.hostIP": address,
    }
    if path in values:
        value = values[path]
        return None if value is None else str(value)
    match = re.match(r"^metadata\.(labels|annotations)\['(.+)'\]$", path)
    if match:
        value = (meta.get(match[1]) or {}).get(match[2])
        return None if value is None else str(value)
    return None


def container_id(pid: int) -> str:
    return f"emulated://{pid}"


def container_status(
    container: Obj, state: Obj, *, ready: bool, container_id: str | None = None
) -> Obj:
    status: Obj = {
        "name": str(container.get("name")),
        "image": str(container.get("image")),
        "imageID": "",
        "ready": ready,
        "restartCount": 0,
        "started": "running" in state,
        "state": state,
    }
    if container_id:
        status["containerID"] = container_id
    return status


def set_conditions(
    status: Obj, *, ready: bool, reason: str | None = None, message: str | None = None
) -> None:
    stamp = semantics.timestamp()
    old = {c.get("type"): c for c in status.get("conditions") or []}
    conditions: list[Obj] = []
    wanted: Iterable[tuple[str, bool]] = (
        ("Initialized", True),
        ("Ready", ready),
        ("ContainersReady", ready),
    )
    for kind, value in wanted:
        text = "True" if value else "False"
        condition: Obj = {"type": kind, "status": text, "lastProbeTime": None}
        previous = old.get(kind)
        condition["lastTransitionTime"] = (
            previous.get("lastTransitionTime")
            if previous and previous.get("status") == text
            else stamp
        )
        if not value and reason:
            condition["reason"] = reason
        if not value and message:
            condition["message"] = message
        conditions.append(condition)
    if "PodScheduled" in old:
        conditions.append(old["PodScheduled"])
    status["conditions"] = conditions
