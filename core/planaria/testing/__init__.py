"""Test helpers for plugin authors: conformance suites that every implementation must pass."""

from planaria.testing.health import CheckCase, HealthCheckConformance
from planaria.testing.storage import StorageConformance, StorageFactorySpec, build_storage

__all__ = [
    "CheckCase",
    "HealthCheckConformance",
    "StorageConformance",
    "StorageFactorySpec",
    "build_storage",
]
