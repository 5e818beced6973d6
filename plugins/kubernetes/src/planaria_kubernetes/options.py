"""Options of the ``kubernetes`` scheduler (``scheduler.options`` in a job's config).

What a user writes in Kubernetes' own shape (volumes, mounts, tolerations) is checked against
the official client's models when the config loads, so a misspelt field is an error that names
its path, never a pod the API server refuses mid-job."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from planaria.durations import Duration

_QUANTITY = re.compile(
    r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$"
)
"""A Kubernetes resource quantity: ``500m``, ``2``, ``16Gi``, ``1e3``."""
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
"""A Kubernetes label key: an optional DNS-subdomain prefix and ``/``, then a name."""

TOPOLOGY_LABELS = {
    "region": "topology.kubernetes.io/region",
    "zone": "topology.kubernetes.io/zone",
    "switch": "network.topology.nvidia.com/leaf",
}
"""The default ``topology_labels``: the well-known region and zone labels that cloud providers
set on every node, and the leaf switch label that NVIDIA's Topograph writes from the fabric.
A cluster that labels its switches otherwise says so in the option."""


def model_errors(kind: str, value: Any) -> list[str]:
    """What is wrong with ``value`` as the client's model ``kind`` (``V1Volume``, ``V1Job``
    ...): each problem with its path, empty when it is valid. The models are generated from
    the Kubernetes OpenAPI document: unknown fields, wrong types and missing required ones
    are all errors."""
    from kubernetes import client
    from pydantic import ValidationError

    model = getattr(client, kind)
    try:
        model.model_validate(value)
    except ValidationError as exc:
        return [
            f"{'.'.join(str(p) for p in error['loc']) or '<top>'}: {error['msg']}"
            for error in exc.errors()
        ]
    return []


def _check_models(kind: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    problems = [f"[{i}].{p}" for i, item in enumerate(items) for p in model_errors(kind, item)]
    if problems:
        raise ValueError(f"not a valid Kubernetes {kind[2:]}: " + "; ".join(problems))
    return items


def _check_quantities(value: dict[str, str]) -> dict[str, str]:
    for name, amount in value.items():
        if not _QUANTITY.match(str(amount)):
            raise ValueError(
                f"{name}: {amount!r} is not a Kubernetes quantity (e.g. 500m, 2, 16Gi)"
            )
    return value


class OwnerRef(BaseModel):
    """An object every pod and the token's Secret belong to: deleting it deletes the job."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    api_version: str = Field(min_length=1, description="e.g. batch/v1")
    kind: str = Field(min_length=1, description="e.g. Job")
    name: str = Field(min_length=1)
    uid: str = Field(min_length=1)


class KubernetesOptions(BaseModel):
    """Which cluster, and what each node's pod is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: str = Field(
        min_length=1, description="the container image of the nodes' pods (planaria installed)"
    )
    namespace: str | None = Field(
        default=None,
        description="where the pods go; default: the master's own namespace in a pod, else "
        "the kubeconfig context's, else `default`",
    )
    kubeconfig: str | None = Field(
        default=None,
        description="kubeconfig file (default: in a pod, the in-cluster config; elsewhere "
        "$KUBECONFIG or ~/.kube/config)",
    )
    context: str | None = Field(default=None, description="kubeconfig context to use")
    python: str | None = Field(
        default=None,
        description="the interpreter in the image that runs the agent "
        "(`python -m planaria agent`); default: the master's own, right when the master runs "
        "in a pod of the same image",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    requests: dict[str, str] = Field(
        default_factory=dict,
        description="resource requests of each pod, e.g. {cpu: '8', memory: 64Gi}",
    )
    limits: dict[str, str] = Field(
        default_factory=dict,
        description="resource limits of each pod, e.g. {nvidia.com/gpu: '8'} or "
        "{huawei.com/Ascend910: '8'}",
    )
    env: dict[str, str] = Field(default_factory=dict, description="more environment variables")
    shm_size: str | None = Field(
        default="8Gi",
        description="/dev/shm as a memory-backed emptyDir of this size (flash checkpoints "
        "live there); none: the runtime's default (often 64 MiB, too small)",
    )
    volumes: list[dict[str, Any]] = Field(
        default_factory=list, description="more pod volumes, as Kubernetes writes them"
    )
    volume_mounts: list[dict[str, Any]] = Field(
        default_factory=list, description="more container volume mounts"
    )
    working_dir: str | None = Field(default=None, description="the container's working dir")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    priority_class: str | None = None
    service_account: str | None = None
    labels: dict[str, str] = Field(default_factory=dict, description="more pod labels")
    annotations: dict[str, str] = Field(default_factory=dict)
    owner: Literal["auto", "none"] | OwnerRef = Field(
        default="auto",
        description="what owns the pods: `auto`, the master's own pod when it runs in one "
        "(so deleting the master deletes the job), else the job's token Secret; or an "
        "object given by api_version, kind, name and uid",
    )
    one_per_node: bool = Field(
        default=True,
        description="at most one pod of the job per Kubernetes node (required pod "
        "anti-affinity on kubernetes.io/hostname)",
    )
    cordon: bool = Field(
        default=False,
        description="cordon a node diagnosed faulty (needs the right to patch nodes)",
    )
    topology_labels: dict[str, str] = Field(
        default_factory=lambda: dict(TOPOLOGY_LABELS),
        description="where a node stands, for rank placement (rendezvous.backend: topology): "
        "each planaria topology label (switch, zone...) and the label of the Kubernetes node "
        "that holds its value, e.g. {switch: cloud.provider.com/topology-rack}; default: "
        "region and zone from topology.kubernetes.io/, switch from "
        "network.topology.nvidia.com/leaf",
    )
    schedule_timeout: Duration = Field(
        default=60.0,
        gt=0,
        description="how long a pod may stay unschedulable before its launch fails (raise it "
        "where a cluster autoscaler adds nodes)",
    )
    start_timeout: Duration = Field(
        default=300.0,
        gt=0,
        description="how long a scheduled pod may take to start (image pull) before it fails",
    )
    parallelism: int = Field(default=32, ge=1, le=512, description="pods created at once")
    stop_grace: Duration = Field(
        default=10.0, ge=0, description="time a pod gets after SIGTERM before SIGKILL"
    )
    request_timeout: Duration = Field(
        default=20.0, gt=0, description="how long one API request may take"
    )

    @field_validator("requests", "limits")
    @classmethod
    def _quantities(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_quantities(value)

    @field_validator("shm_size")
    @classmethod
    def _shm(cls, value: str | None) -> str | None:
        if value is not None:
            _check_quantities({"shm_size": value})
        return value

    @field_validator("topology_labels")
    @classmethod
    def _label_keys(cls, value: dict[str, str]) -> dict[str, str]:
        for name, key in value.items():
            if not name:
                raise ValueError(f"{key!r}: the topology label it fills has no name")
            if len(key) > 316 or not _LABEL_KEY.match(key):
                raise ValueError(
                    f"{name}: {key!r} is not a Kubernetes label key (e.g. "
                    "topology.kubernetes.io/zone)"
                )
        return value

    @field_validator("volumes")
    @classmethod
    def _volumes(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return _check_models("V1Volume", value)

    @field_validator("volume_mounts")
    @classmethod
    def _mounts(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return _check_models("V1VolumeMount", value)

    @field_validator("tolerations")
    @classmethod
    def _tolerations(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return _check_models("V1Toleration", value)
