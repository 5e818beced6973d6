"""Test helpers for plugin authors: conformance suites that every implementation must pass."""

from planaria.testing.health import CheckCase, HealthCheckConformance
from planaria.testing.node_benchmark import NodeBenchmarkConformance
from planaria.testing.scheduler import Cluster, SchedulerConformance
from planaria.testing.storage import StorageConformance, StorageFactorySpec, build_storage

__all__ = [
    "CheckCase",
    "Cluster",
    "HealthCheckConformance",
    "NodeBenchmarkConformance",
    "SchedulerConformance",
    "StorageConformance",
    "StorageFactorySpec",
    "build_storage",
]
