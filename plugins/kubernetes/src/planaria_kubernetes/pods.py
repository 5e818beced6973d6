"""What the job puts on the cluster, built with the official client's typed models: each node's
pod, the Secret that carries the job's token, their names and labels."""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterable, Mapping
from typing import Any

from planaria.protocol import HOST_ENV, NODE_ID_ENV, TOKEN_ENV
from planaria.scheduler.api import LaunchSpec
from planaria_kubernetes.options import KubernetesOptions, OwnerRef

GROUP = "planaria.dev"
JOB_LABEL = f"{GROUP}/job"
RUN_LABEL = f"{GROUP}/run"
NODE_LABEL = f"{GROUP}/node"
MANAGED = {"app.kubernetes.io/managed-by": "planaria"}
HOSTNAME = "kubernetes.io/hostname"
TOKEN_KEY = "token"
CONTAINER = "agent"


def dns_label(text: str, limit: int = 63) -> str:
    """``text`` as a DNS-1123 label (lower case, digits, '-'; at most ``limit`` characters),
    with a short hash of the original when it had to be changed or cut, so that two different
    names never meet."""
    clean = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-") or "x"
    if clean == text and len(clean) <= limit:
        return clean
    digest = hashlib.sha256(text.encode()).hexdigest()[:6]
    return f"{clean[: limit - 7].rstrip('-')}-{digest}"


def label_value(text: str) -> str:
    """``text`` as a label value (at most 63 of ``[A-Za-z0-9._-]``, alphanumeric at the ends)."""
    clean = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")
    if clean == text and len(clean) <= 63:
        return clean
    digest = hashlib.sha256(text.encode()).hexdigest()[:6]
    return f"{clean[:56].strip('-._')}-{digest}"


def run_selector(run_id: str) -> str:
    return f"{RUN_LABEL}={label_value(run_id)}"


def labels(spec: LaunchSpec, node_id: str | None = None) -> dict[str, str]:
    found = {
        **MANAGED,
        JOB_LABEL: label_value(spec.job),
        RUN_LABEL: label_value(spec.run_id or spec.job),
    }
    if node_id is not None:
        found[NODE_LABEL] = label_value(node_id)
    return found


def pod_name(spec: LaunchSpec, node_id: str) -> str:
    return dns_label(f"{spec.run_id or spec.job}-{node_id}")


def secret_name(spec: LaunchSpec) -> str:
    return dns_label(f"{spec.run_id or spec.job}-token")


def owner_reference(owner: OwnerRef) -> Any:
    from kubernetes import client

    return client.V1OwnerReference(
        api_version=owner.api_version,
        kind=owner.kind,
        name=owner.name,
        uid=owner.uid,
        block_owner_deletion=True,
    )


def secret(spec: LaunchSpec, owner: OwnerRef | None) -> Any:
    """The Secret with the job's token: the only place the token is written on the cluster."""
    from kubernetes import client

    token = spec.env.get(TOKEN_ENV, "")
    return client.V1Secret(
        api_version="v1",
        kind="Secret",
        metadata=client.V1ObjectMeta(
            name=secret_name(spec),
            labels=labels(spec),
            owner_references=None if owner is None else [owner_reference(owner)],
        ),
        type="Opaque",
        data={TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    )


def _env(
    spec: LaunchSpec, options: KubernetesOptions, node_id: str, extra: Mapping[str, str]
) -> list[Any]:
    from kubernetes import client

    plain = {**spec.env, **options.env, **extra, NODE_ID_ENV: node_id}
    plain.pop(TOKEN_ENV, None)
    plain.pop(HOST_ENV, None)
    env = [client.V1EnvVar(name=k, value=v) for k, v in sorted(plain.items())]
    env.append(
        client.V1EnvVar(
            name=HOST_ENV,
            value_from=client.V1EnvVarSource(
                field_ref=client.V1ObjectFieldSelector(field_path="spec.nodeName")
            ),
        )
    )
    if TOKEN_ENV in spec.env:
        env.append(
            client.V1EnvVar(
                name=TOKEN_ENV,
                value_from=client.V1EnvVarSource(
                    secret_key_ref=client.V1SecretKeySelector(name=secret_name(spec), key=TOKEN_KEY)
                ),
            )
        )
    return env


def affinity(spec: LaunchSpec, options: KubernetesOptions, excluded: Iterable[str]) -> Any:
    """Required: never on an excluded host; with ``one_per_node``, never beside another pod
    of this run."""
    from kubernetes import client

    avoid = sorted(set(excluded))
    node = None
    if avoid:
        node = client.V1NodeAffinity(
            required_during_scheduling_ignored_during_execution=client.V1NodeSelector(
                node_selector_terms=[
                    client.V1NodeSelectorTerm(
                        match_expressions=[
                            client.V1NodeSelectorRequirement(
                                key=HOSTNAME, operator="NotIn", values=avoid
                            )
                        ]
                    )
                ]
            )
        )
    spread = None
    if options.one_per_node:
        run = labels(spec)[RUN_LABEL]
        spread = client.V1PodAntiAffinity(
            required_during_scheduling_ignored_during_execution=[
                client.V1PodAffinityTerm(
                    label_selector=client.V1LabelSelector(match_labels={RUN_LABEL: run}),
                    topology_key=HOSTNAME,
                )
            ]
        )
    if node is None and spread is None:
        return None
    return client.V1Affinity(node_affinity=node, pod_anti_affinity=spread)


def pod(
    spec: LaunchSpec,
    options: KubernetesOptions,
    node_id: str,
    *,
    owner: OwnerRef | None,
    excluded: Iterable[str] = (),
    extra_env: Mapping[str, str] | None = None,
) -> Any:
    """The pod of node ``node_id``: the agent as its one container, restartPolicy Never (the
    master alone decides what replaces a node)."""
    from kubernetes import client

    command = list(spec.command)
    if options.python is not None and command:
        command[0] = options.python
    volumes = [client.V1Volume.model_validate(v) for v in options.volumes]
    mounts = [client.V1VolumeMount.model_validate(m) for m in options.volume_mounts]
    if options.shm_size is not None:
        volumes.append(
            client.V1Volume(
                name="dshm",
                empty_dir=client.V1EmptyDirVolumeSource(
                    medium="Memory", size_limit=options.shm_size
                ),
            )
        )
        mounts.append(client.V1VolumeMount(name="dshm", mount_path="/dev/shm"))
    resources = None
    if options.requests or options.limits:
        resources = client.V1ResourceRequirements(
            requests=dict(options.requests) or None, limits=dict(options.limits) or None
        )
    container = client.V1Container(
        name=CONTAINER,
        image=options.image,
        image_pull_policy=options.image_pull_policy,
        command=command,
        env=_env(spec, options, node_id, extra_env or {}),
        resources=resources,
        volume_mounts=mounts or None,
        working_dir=options.working_dir,
    )
    return client.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=client.V1ObjectMeta(
            name=pod_name(spec, node_id),
            labels={**options.labels, **labels(spec, node_id)},
            annotations=dict(options.annotations) or None,
            owner_references=None if owner is None else [owner_reference(owner)],
        ),
        spec=client.V1PodSpec(
            containers=[container],
            restart_policy="Never",
            termination_grace_period_seconds=round(options.stop_grace),
            node_selector=dict(options.node_selector) or None,
            tolerations=[client.V1Toleration.model_validate(t) for t in options.tolerations]
            or None,
            priority_class_name=options.priority_class,
            service_account_name=options.service_account,
            affinity=affinity(spec, options, excluded),
            volumes=volumes or None,
        ),
    )


def as_dict(model: Any) -> dict[str, Any]:
    """A model as the API server reads it (camelCase keys, no empty fields)."""
    from kubernetes import client

    serialised: dict[str, Any] = client.ApiClient().sanitize_for_serialization(model)  # type: ignore[no-untyped-call]
    return serialised
