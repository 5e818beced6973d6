"""What cannot start is an error before any training: ``planaria run`` exits 2 with a message
that names the pod and Kubernetes' reason, and leaves no pod and no Secret behind. The cluster
is the emulated one; the API server's refusals are the real API's (403 Forbidden, the
scheduler's Unschedulable condition, the kubelet's ImagePullBackOff)."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from planaria.testing.jobs import run_planaria
from planaria_kubernetes import pods
from planaria_kubernetes.testing import EmulatedCluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmulatedCluster]:
    with EmulatedCluster(nodes=("kube-a", "kube-b", "kube-c")) as emulated:
        yield emulated


def config(where: Path, **options: object) -> Path:
    data = {
        "job": {
            "name": "k8s-errors",
            "command": [sys.executable, "-c", "import time; time.sleep(60)"],
            "nodes": 2,
            "procs_per_node": 1,
        },
        "scheduler": {
            "backend": "kubernetes",
            "options": {"image": "planaria-test:1", "stop_grace": "1s", **options},
        },
        "diagnosis": {"checks": [], "preflight": False},
    }
    path = where / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def on(cluster: EmulatedCluster) -> dict[str, Any]:
    return {"kubeconfig": str(cluster.kubeconfig), "namespace": cluster.namespace}


def left(cluster: EmulatedCluster) -> list[str]:
    return [
        f"{plural}/{o['metadata']['name']}"
        for plural in ("pods", "secrets")
        for o in cluster.objects(plural)
        if (o["metadata"].get("labels") or {}).get(pods.JOB_LABEL) == "k8s-errors"
    ]


def run(where: Path, path: Path) -> tuple[int, str, float]:
    started = time.monotonic()
    done = run_planaria(where, "run", str(path), timeout=120)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def test_an_unreachable_cluster_is_a_config_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "u", "user": {}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    code, output, took = run(tmp_path, config(tmp_path, kubeconfig=str(kubeconfig)))
    assert code == 2, output
    assert "scheduler.options.kubeconfig" in output
    assert f"cannot reach the Kubernetes API server at http://127.0.0.1:{port}" in output
    assert took < 30


def test_rbac_forbidding_pod_creation_is_an_error_naming_the_pod(
    tmp_path: Path, cluster: EmulatedCluster
) -> None:
    cluster.forbid("create", "pods")
    try:
        code, output, _ = run(tmp_path, config(tmp_path, **on(cluster)))
    finally:
        cluster.allow("create", "pods")
    assert code == 2, output
    assert "cannot create pod k8s-errors-" in output and "-node-" in output
    assert "pods is forbidden" in output
    assert left(cluster) == []


def test_an_image_that_cannot_be_pulled_is_an_error_after_the_start_timeout(
    tmp_path: Path, cluster: EmulatedCluster
) -> None:
    cluster.bad_image("registry.invalid/nope:1")
    path = config(tmp_path, **on(cluster), image="registry.invalid/nope:1", start_timeout="3s")
    code, output, took = run(tmp_path, path)
    assert code == 2, output
    assert "did not start within 3s: ImagePullBackOff" in output
    assert "pod k8s-errors-" in output
    assert left(cluster) == []
    assert took < 60


def test_a_request_no_node_can_hold_is_an_error_with_the_scheduler_s_reason(
    tmp_path: Path, cluster: EmulatedCluster
) -> None:
    path = config(tmp_path, **on(cluster), limits={"nvidia.com/gpu": "1"}, schedule_timeout="2s")
    code, output, _ = run(tmp_path, path)
    assert code == 2, output
    assert "could not be scheduled for 2s" in output
    assert "0/3 nodes are available" in output and "nvidia.com/gpu" in output
    assert left(cluster) == []
