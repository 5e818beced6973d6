"""The connection to the API server: which config (in-cluster or kubeconfig), which namespace,
and Kubernetes' errors as planaria's, with the pod (or object) and the API server's reason."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from planaria.errors import SchedulerError
from planaria_kubernetes.options import KubernetesOptions

IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
POD_NAME_ENV = "PLANARIA_POD_NAME"
"""Set (from the downward API) in the master's pod by the manifests: the pod that owns the job."""


def in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and IN_CLUSTER_NAMESPACE.exists()


def connect(options: KubernetesOptions) -> Any:
    """An ``ApiClient`` of its own (the client's global configuration is left alone)."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        if options.kubeconfig is None and in_cluster():
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=options.kubeconfig,
                context=options.context,
                client_configuration=configuration,
            )
    except (config.ConfigException, OSError, ValueError, TypeError) as exc:
        where = options.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise SchedulerError(f"cannot load the Kubernetes config {where}: {exc}") from exc
    # Pods are created this many at once; each needs a connection of its own.
    configuration.connection_pool_maxsize = max(options.parallelism, 4)
    configuration.retries = 0
    return client.ApiClient(configuration)


def namespace(options: KubernetesOptions) -> str:
    """The namespace of the job's pods (see :attr:`KubernetesOptions.namespace`)."""
    if options.namespace:
        return options.namespace
    if options.kubeconfig is None and in_cluster():
        return IN_CLUSTER_NAMESPACE.read_text().strip() or "default"
    from kubernetes import config

    try:
        _, active = config.list_kube_config_contexts(config_file=options.kubeconfig)  # type: ignore[no-untyped-call]
    except (config.ConfigException, OSError, ValueError, TypeError):
        return "default"
    if options.context:
        contexts, _ = config.list_kube_config_contexts(config_file=options.kubeconfig)  # type: ignore[no-untyped-call]
        active = next((c for c in contexts if c.get("name") == options.context), active)
    return str((active or {}).get("context", {}).get("namespace") or "default")


def status_of(exc: BaseException) -> tuple[int, str]:
    """An API error's HTTP status and the API server's own words (its Status object's reason
    and message), or what the connection said."""
    from kubernetes.client.exceptions import ApiException

    if isinstance(exc, ApiException):
        try:
            body = json.loads(exc.body or "{}")
        except (ValueError, TypeError):
            body = {}
        message = body.get("message") if isinstance(body, dict) else None
        reason = (body.get("reason") if isinstance(body, dict) else None) or exc.reason
        return int(exc.status or 0), f"{reason}: {message}" if message else str(reason)
    return 0, " ".join(str(exc).split())[:500] or type(exc).__name__


def error(what: str, exc: BaseException) -> SchedulerError:
    """``what`` failed, with Kubernetes' reason: a :class:`SchedulerError` to raise."""
    code, said = status_of(exc)
    hint = ""
    if code == 403:
        hint = " (the master's service account lacks the right: see `planaria kubernetes manifest`)"
    elif code == 0:
        hint = " (is the API server reachable?)"
    return SchedulerError(f"{what}: {said}{hint}")
