"""A pytest plugin: after every test, no process it started still runs and no file it had
planaria create in /dev/shm is left. Load it from a ``conftest.py``::

    pytest_plugins = ["planaria.testing.leaks"]

It looks only at what the test itself started, so that other planaria jobs (or other test
sessions) running on the same machine neither fail a test nor hide its leftovers:

- processes by the session's marker (:mod:`planaria.leftovers`), which every process a test
  starts inherits through ``os.environ``;
- files in /dev/shm by a tag of the test's own, ``PLANARIA_SHM_TAG`` in ``os.environ`` while it
  runs: planaria puts it in the name of everything it creates there
  (:func:`planaria.shm.name_prefix`), so the check reads only the names that carry it.

What a session starts on purpose to outlive its tests (a cluster's daemons) is started with
``env=leftovers.unmarked(os.environ)``.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from planaria import leftovers
from planaria.shm import SHM_DIR, TAG_ENV, name_prefix
from planaria.testing.leftovers import WAIT, assert_nothing_left


def shm_left(prefix: str, base: Path = SHM_DIR) -> list[str]:
    """The names in ``base`` that start with ``prefix``, sorted."""
    try:
        return sorted(name for name in os.listdir(base) if name.startswith(prefix))
    except FileNotFoundError:
        return []


def assert_no_shm_left(prefix: str, wait: float = WAIT, base: Path = SHM_DIR) -> None:
    """Fail the test naming every entry of ``base`` whose name starts with ``prefix`` still there
    after ``wait`` seconds (a persister frees its node's files only once its agent is gone)."""
    deadline = time.monotonic() + wait
    while (left := shm_left(prefix, base)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        pytest.fail(f"left in {base}: {left}", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def trace_marker() -> Iterator[str]:
    """This session's marker in os.environ: every process a test starts inherits it."""
    with leftovers.marking() as marker:
        yield marker


@pytest.fixture(autouse=True)
def shm_tag(monkeypatch: pytest.MonkeyPatch) -> str:
    """This test's tag in ``PLANARIA_SHM_TAG``: what it has planaria create in /dev/shm is named
    ``planaria-<tag>-...``, and only those names are its own."""
    tag = f"t{secrets.token_hex(4)}"
    monkeypatch.setenv(TAG_ENV, tag)
    return tag


@pytest.fixture(autouse=True)
def no_shm_leak(shm_tag: str) -> Iterator[None]:
    """No test leaves a file of its own in /dev/shm (segments, progress boards, sockets)."""
    prefix = name_prefix()  # the tag in os.environ now
    yield
    assert_no_shm_left(prefix)


@pytest.fixture(autouse=True)
def nothing_left_running(trace_marker: str, no_shm_leak: None) -> Iterator[None]:
    """No test leaves a process running: whatever still carries the session's marker after it
    (allowing processes on their way out a few seconds) is killed and fails the test. It asks
    for ``no_shm_leak`` so that its own check comes first: a leftover holding shared memory is
    named as the process it is."""
    yield
    assert_nothing_left(trace_marker)
