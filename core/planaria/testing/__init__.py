"""Test helpers for plugin authors: conformance suites that every implementation must pass."""

from planaria.testing.storage import StorageConformance, StorageFactorySpec, build_storage

__all__ = ["StorageConformance", "StorageFactorySpec", "build_storage"]
