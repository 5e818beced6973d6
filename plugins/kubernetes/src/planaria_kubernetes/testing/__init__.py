"""An emulated Kubernetes cluster for tests (see :mod:`planaria_kubernetes.testing.cluster`)."""

from planaria_kubernetes.testing.cluster import EmulatedCluster

__all__ = ["EmulatedCluster"]
