"""What a user applies to run a job on Kubernetes: ``planaria kubernetes manifest job.yaml``.

- the job's config as a ConfigMap, mounted where the master reads it;
- the master as a Job (``backoffLimit: 0``: a master that died is resumed with
  ``planaria run --resume``, never started over by Kubernetes), with the nodes' volumes (the
  job's workdir, where its run directory is, on the volume they share), its pod IP handed to the
  agents as the master's address (``master.advertise``), its own pod's name passed down so
  that the node pods it creates are owned by it: deleting the Job deletes everything;
- its ServiceAccount with the least rights it needs: in its namespace pods (create, get,
  list, watch, delete), secrets (create, get, delete) and events (create, get, list, watch);
  cluster-wide nodes (get, list, watch, and patch only with ``cordon: true``).

Every object is built with the official client's models and checked against them again once
serialised (:func:`planaria_kubernetes.options.model_errors`), as the API server would.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from planaria_kubernetes import pods
from planaria_kubernetes.api import POD_NAME_ENV
from planaria_kubernetes.options import KubernetesOptions, model_errors

CONFIG_DIR = "/etc/planaria"
CONFIG_FILE = "job.yaml"
POD_IP_ENV = "PLANARIA_POD_IP"


def cluster_name(namespace: str, job: str) -> str:
    """The name of the job's ClusterRole and ClusterRoleBinding. They are cluster-wide, so the
    name must tell every (namespace, job) pair apart, which joining the two cannot ('team-a' +
    'train' and 'team' + 'a-train'): a hash of the pair ends it, after as much of the pair as
    fits a DNS-1123 label, for a reader."""
    digest = hashlib.sha256(json.dumps([namespace, job]).encode()).hexdigest()[:12]
    readable = re.sub(r"[^a-z0-9-]+", "-", f"planaria-{namespace}-{job}".lower())
    return f"{readable[: 63 - len(digest) - 7].strip('-')}-nodes-{digest}"


def _rules(options: KubernetesOptions) -> tuple[list[Any], list[Any]]:
    from kubernetes import client

    namespaced = [
        client.V1PolicyRule(
            api_groups=[""], resources=["pods"], verbs=["create", "get", "list", "watch", "delete"]
        ),
        client.V1PolicyRule(
            api_groups=[""], resources=["secrets"], verbs=["create", "get", "delete"]
        ),
        client.V1PolicyRule(
            api_groups=[""], resources=["events"], verbs=["create", "get", "list", "watch"]
        ),
    ]
    node_verbs = ["get", "list", "watch"] + (["patch"] if options.cordon else [])
    cluster = [client.V1PolicyRule(api_groups=[""], resources=["nodes"], verbs=node_verbs)]
    return namespaced, cluster


def manifests(
    job: str, config_text: str, options: KubernetesOptions, *, python: str = "python"
) -> list[Any]:
    """The objects to apply, as client models, in the order to apply them."""
    from kubernetes import client

    name = pods.dns_label(f"planaria-{job}")
    namespace = options.namespace or "default"
    labels = {**pods.MANAGED, pods.JOB_LABEL: pods.label_value(job)}

    def meta(object_name: str, *, namespaced: bool = True) -> Any:
        return client.V1ObjectMeta(
            name=object_name, namespace=namespace if namespaced else None, labels=labels
        )

    namespaced, cluster = _rules(options)
    nodes_role = cluster_name(namespace, job)
    account = client.V1ServiceAccount(api_version="v1", kind="ServiceAccount", metadata=meta(name))
    subject = client.RbacV1Subject(kind="ServiceAccount", name=name, namespace=namespace)
    role = client.V1Role(
        api_version="rbac.authorization.k8s.io/v1",
        kind="Role",
        metadata=meta(name),
        rules=namespaced,
    )
    binding = client.V1RoleBinding(
        api_version="rbac.authorization.k8s.io/v1",
        kind="RoleBinding",
        metadata=meta(name),
        role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name=name),
        subjects=[subject],
    )
    node_role = client.V1ClusterRole(
        api_version="rbac.authorization.k8s.io/v1",
        kind="ClusterRole",
        metadata=meta(nodes_role, namespaced=False),
        rules=cluster,
    )
    node_binding = client.V1ClusterRoleBinding(
        api_version="rbac.authorization.k8s.io/v1",
        kind="ClusterRoleBinding",
        metadata=meta(nodes_role, namespaced=False),
        role_ref=client.V1RoleRef(
            api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=nodes_role
        ),
        subjects=[subject],
    )
    config_map = client.V1ConfigMap(
        api_version="v1",
        kind="ConfigMap",
        metadata=meta(f"{name}-config"),
        data={CONFIG_FILE: config_text},
    )
    command = [
        python, "-m", "planaria", "run", f"{CONFIG_DIR}/{CONFIG_FILE}",
        "--set", "master.host=0.0.0.0",
        # Kubernetes expands $(VAR) in a command from the container's environment.
        "--set", f"master.advertise=$({POD_IP_ENV})",
    ]  # fmt: skip
    field = client.V1ObjectFieldSelector
    env = [
        client.V1EnvVar(
            name=POD_IP_ENV,
            value_from=client.V1EnvVarSource(field_ref=field(field_path="status.podIP")),
        ),
        client.V1EnvVar(
            name=POD_NAME_ENV,
            value_from=client.V1EnvVarSource(field_ref=field(field_path="metadata.name")),
        ),
    ]
    master = client.V1Container(
        name="master",
        image=options.image,
        image_pull_policy=options.image_pull_policy,
        command=command,
        env=env,
        # The nodes' volumes too: the run directory (its journal, for `planaria run --resume`)
        # and the checkpoints are under the job's workdir, on the volume every pod shares.
        volume_mounts=[
            client.V1VolumeMount(name="config", mount_path=CONFIG_DIR, read_only=True),
            *(client.V1VolumeMount.model_validate(m) for m in options.volume_mounts),
        ],
        working_dir=options.working_dir,
    )
    job_object = client.V1Job(
        api_version="batch/v1",
        kind="Job",
        metadata=meta(name),
        spec=client.V1JobSpec(
            backoff_limit=0,
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(
                    service_account_name=name,
                    restart_policy="Never",
                    containers=[master],
                    volumes=[
                        client.V1Volume(
                            name="config",
                            config_map=client.V1ConfigMapVolumeSource(name=f"{name}-config"),
                        ),
                        *(client.V1Volume.model_validate(v) for v in options.volumes),
                    ],
                    node_selector=dict(options.node_selector) or None,
                    tolerations=[client.V1Toleration.model_validate(t) for t in options.tolerations]
                    or None,
                    priority_class_name=options.priority_class,
                ),
            ),
        ),
    )
    return [config_map, account, role, binding, node_role, node_binding, job_object]


def check(objects: list[dict[str, Any]]) -> list[str]:
    """Each object checked against its kind's model: the problems, with where."""
    problems = []
    for number, item in enumerate(objects):
        kind = str(item.get("kind", ""))
        version = str(item.get("apiVersion", "")).rpartition("/")[2]
        model = f"{version.capitalize()}{kind}"
        from kubernetes import client

        if not hasattr(client, model):
            problems.append(f"object {number}: unknown kind {item.get('apiVersion')}/{kind}")
            continue
        problems += [f"{kind} {number}: {p}" for p in model_errors(model, item)]
    return problems
