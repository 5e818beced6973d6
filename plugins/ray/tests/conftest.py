"""A real Ray cluster for the whole session (:class:`planaria_ray.testing.LocalCluster`: a
head and three worker raylets, each in a network namespace of its own, a host of its own,
labelled with a switch in turn, s1, s2, s1...; this machine joins their bridge as the driver's
node), and a check after every test that it left nothing behind (the cluster's own processes
carry no marker; the actors the tests start do). The cluster needs root (network namespaces):
without, the tests that use it skip, saying why."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("ray")
from planaria_ray.testing import LocalCluster, unavailable

SWITCHES = {f"n{i}": {"switch": "s1" if i % 2 else "s2"} for i in range(1, 7)}
"""The Ray node labels of the raylets, by namespace: the first three are on switches s1, s2, s1
(and the spares, added later in their turn, s2, s1, s2)."""

pytest_plugins = ["planaria.testing.leaks"]
"""After every test: nothing it started still runs, nothing it created is left in /dev/shm."""


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[LocalCluster]:
    why = unavailable()
    if why is not None:
        pytest.skip(f"the Ray test cluster cannot run here: {why}")
    cluster = LocalCluster(workers=3, labels=SWITCHES)
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture
def ray_address(ray_cluster: LocalCluster) -> str:
    return ray_cluster.address


@pytest.fixture(scope="session")
def clean_weights(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The job of the end-to-end tests without a fault, on the local scheduler (2 nodes of 1
    worker): what every run of it with a fault must end with, bitwise. Once a session."""
    from test_jobs import job

    from planaria.testing.jobs import final_weights, run_planaria

    where = tmp_path_factory.mktemp("clean")
    done = run_planaria(where, "run", str(job(where)))
    assert done.returncode == 0, done.stdout + done.stderr
    return final_weights(where)
