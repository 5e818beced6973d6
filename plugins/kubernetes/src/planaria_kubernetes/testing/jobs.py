"""Jobs on an :class:`~planaria_kubernetes.testing.EmulatedCluster`: the ``scheduler`` section
that points a job at it, where its master listens, and what the job left on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from planaria.testing.jobs import bind_every_interface
from planaria_kubernetes import pods
from planaria_kubernetes.testing.cluster import EmulatedCluster

IMAGE = "planaria-test:1"


def scheduler_section(cluster: EmulatedCluster, where: Path, **options: object) -> dict[str, Any]:
    """The ``scheduler`` section of a job run on ``cluster`` from ``where`` (the pods' working
    directory), with ``options`` over the defaults (a short ``stop_grace``)."""
    return {
        "backend": "kubernetes",
        "options": {
            "image": IMAGE,
            "kubeconfig": str(cluster.kubeconfig),
            "namespace": cluster.namespace,
            "working_dir": str(where),
            "stop_grace": "1s",
            **options,
        },
    }


def listen_for_nodes(config: Path, cluster: EmulatedCluster) -> Path:
    """Have the job's master, run on this machine, listen where the cluster's nodes reach it:
    on every interface (``master.host: 0.0.0.0``, no ``master.advertise``: the master finds
    the address from the nodes' ``InternalIP``) when the nodes are hosts of their own, on
    loopback as it does by default when they are this machine."""
    return config if cluster.network is None else bind_every_interface(config)


def job_objects(cluster: EmulatedCluster, plural: str, job_name: str) -> list[dict[str, Any]]:
    """The objects of ``plural`` (``pods``, ``secrets``) that carry the job's label."""
    return [
        o
        for o in cluster.objects(plural)
        if (o["metadata"].get("labels") or {}).get(pods.JOB_LABEL) == job_name
    ]
