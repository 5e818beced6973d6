"""An emulated Kubernetes cluster (:class:`planaria_kubernetes.testing.EmulatedCluster`: an API
server on loopback, a scheduler, and a kubelet that runs pods as processes of this machine), and
a check after every test that it left nothing behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from planaria import leftovers
from planaria.testing import assert_nothing_left


@pytest.fixture(scope="session", autouse=True)
def trace_marker() -> Iterator[str]:
    with leftovers.marking() as marker:
        yield marker


@pytest.fixture(autouse=True)
def nothing_left_running(trace_marker: str) -> Iterator[None]:
    yield
    assert_nothing_left(trace_marker)
