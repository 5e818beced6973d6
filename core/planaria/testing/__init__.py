"""Test helpers for plugin authors: conformance suites that every implementation must pass;
:func:`run_check`, one case of a health check run as ``planaria check`` runs it; and
:func:`validate_options`, a plugin's options read as planaria reads them from a config (its
errors a :class:`~planaria.errors.ConfigError`, also exported here, naming each problem)."""

from planaria.errors import ConfigError
from planaria.plugin.manager import validate_options
from planaria.testing.fault_pattern import (
    ORDINARY_LOG_LINES,
    FaultPatternConformance,
    assert_classifies,
    assert_unclassified,
)
from planaria.testing.health import CheckCase, HealthCheckConformance, run_check
from planaria.testing.leftovers import assert_nothing_left
from planaria.testing.node_benchmark import NodeBenchmarkConformance
from planaria.testing.rendezvous import RendezvousConformance
from planaria.testing.scheduler import Cluster, SchedulerConformance
from planaria.testing.storage import StorageConformance, StorageFactorySpec, build_storage

__all__ = [
    "ORDINARY_LOG_LINES",
    "CheckCase",
    "Cluster",
    "ConfigError",
    "FaultPatternConformance",
    "HealthCheckConformance",
    "NodeBenchmarkConformance",
    "RendezvousConformance",
    "SchedulerConformance",
    "StorageConformance",
    "StorageFactorySpec",
    "assert_classifies",
    "assert_nothing_left",
    "assert_unclassified",
    "build_storage",
    "run_check",
    "validate_options",
]
