"""A check that a test left no process running, for plugin authors' test suites and ours.

A session marker (:mod:`planaria.leftovers`) in ``os.environ`` reaches every process a test
starts, whatever session or parent it ends up with; after each test, whatever still carries it
fails the test, killed. In a ``conftest.py``::

    import pytest
    from planaria import leftovers
    from planaria.testing import assert_nothing_left

    @pytest.fixture(scope="session", autouse=True)
    def trace_marker():
        with leftovers.marking() as marker:
            yield marker

    @pytest.fixture(autouse=True)
    def nothing_left_running(trace_marker):
        yield
        assert_nothing_left(trace_marker)

What a session starts on purpose to outlive its tests (a cluster's daemons) is started with
``env=leftovers.unmarked(os.environ)``.
"""

from __future__ import annotations

from collections.abc import Collection

import pytest

from planaria.leftovers import describe, kill_survivors

WAIT = 10.0
"""How long processes on their way out get (an agent's persister frees its files after the
agent is gone) before they count as left behind."""


def assert_nothing_left(marker: str, wait: float = WAIT, *, exclude: Collection[int] = ()) -> None:
    """Fail the test naming every process but this one (and ``exclude``) that still carries
    ``marker`` after ``wait`` seconds, killed first. One scan of /proc when there is none."""
    found = kill_survivors(marker, wait, exclude=exclude)
    if found:
        pytest.fail(
            f"{len(found)} process(es) started by this test still ran after it (killed now):\n"
            f"{describe(found)}",
            pytrace=False,
        )
