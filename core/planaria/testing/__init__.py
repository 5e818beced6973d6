"""Test helpers for plugin authors: conformance suites that every implementation must pass."""

from planaria.testing.fault_pattern import (
    ORDINARY_LOG_LINES,
    FaultPatternConformance,
    assert_classifies,
    assert_unclassified,
)
from planaria.testing.health import CheckCase, HealthCheckConformance
from planaria.testing.leftovers import assert_nothing_left
from planaria.testing.node_benchmark import NodeBenchmarkConformance
from planaria.testing.scheduler import Cluster, SchedulerConformance
from planaria.testing.storage import StorageConformance, StorageFactorySpec, build_storage

__all__ = [
    "ORDINARY_LOG_LINES",
    "CheckCase",
    "Cluster",
    "FaultPatternConformance",
    "HealthCheckConformance",
    "NodeBenchmarkConformance",
    "SchedulerConformance",
    "StorageConformance",
    "StorageFactorySpec",
    "assert_classifies",
    "assert_nothing_left",
    "assert_unclassified",
    "build_storage",
]
