"""pytest fixtures over :mod:`planaria.testing.netns`: networks of namespaces, made as root,
always removed, and skipped with the reason where this machine cannot make them.

A test module takes them with ``pytest_plugins = ["netns"]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from planaria.testing.netns import Network, unavailable


@pytest.fixture(scope="session")
def netns_available() -> None:
    """Skip (with the reason) where network namespaces cannot be made: not root, no
    iproute2, or a kernel or container that refuses them."""
    why = unavailable()
    if why is not None:
        pytest.skip(why)


@pytest.fixture
def network(netns_available: None) -> Iterator[Callable[..., Network]]:
    """``network("master", "n0", "n1")`` makes a :class:`Network` with those participants
    (``host=True``: the machine joins it too, see :class:`Network`).

    Teardown removes every network made, whatever the test did; a process still inside one
    then (the test should have ended everything it started) is killed and fails the test."""
    made: list[Network] = []

    def make(*names: str, host: bool = False) -> Network:
        net = Network(names, host=host)
        made.append(net)
        net.create()
        return net

    yield make
    left: dict[str, list[int]] = {}
    for net in made:
        killed = net.close()
        if killed:
            left[net.tag] = killed
    assert not left, f"processes were still running in the test's namespaces: {left}"
