"""The ``kubernetes`` scheduler passes the scheduler conformance suite on an emulated cluster of
four nodes, whose kubelet runs each pod as a process of this machine (so /proc shows them)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from planaria.testing import SchedulerConformance
from planaria_kubernetes import KubernetesOptions, KubernetesScheduler
from planaria_kubernetes.testing import EmulatedCluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmulatedCluster]:
    with EmulatedCluster(nodes=("kube-a", "kube-b", "kube-c", "kube-d")) as emulated:
        yield emulated


class TestKubernetesScheduler(SchedulerConformance):
    @pytest.fixture
    def scheduler(self, cluster: EmulatedCluster) -> KubernetesScheduler:
        options = KubernetesOptions(
            image="planaria-test",
            kubeconfig=str(cluster.kubeconfig),
            namespace=cluster.namespace,
            stop_grace=0.5,
        )
        return KubernetesScheduler(options)
