"""A real Ray cluster for the whole session (:class:`planaria_ray.testing.LocalCluster`: a
head and three worker raylets on this machine, all on loopback), and a check after every test
that it left nothing behind (the cluster's own processes carry no marker; the actors the tests
start do)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from planaria import leftovers
from planaria.testing import assert_nothing_left

pytest.importorskip("ray")
from planaria_ray.testing import LocalCluster


@pytest.fixture(scope="session", autouse=True)
def trace_marker() -> Iterator[str]:
    with leftovers.marking() as marker:
        yield marker


@pytest.fixture(autouse=True)
def nothing_left_running(trace_marker: str) -> Iterator[None]:
    yield
    assert_nothing_left(trace_marker)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[LocalCluster]:
    cluster = LocalCluster(workers=3)
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture
def ray_address(ray_cluster: LocalCluster) -> str:
    return ray_cluster.address
