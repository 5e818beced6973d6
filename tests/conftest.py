from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from planaria import leftovers
from planaria.testing import assert_nothing_left

FIXTURES = Path(__file__).parent / "fixtures"
PLUGIN_FIXTURES = FIXTURES / "plugins"
SHM = Path("/dev/shm")


def _shm_files() -> set[str]:
    try:
        return {name for name in os.listdir(SHM) if "planaria" in name}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def no_shm_leak() -> Iterator[None]:
    """No test leaves a planaria file in /dev/shm (segments, progress boards, sockets).

    A persister frees its node's files once its agent is gone, which takes a moment after the
    agent died: allow a few seconds before calling it a leak. The check sees the whole
    machine: ``PLANARIA_TEST_SHM_CHECK=0`` turns it off while other planaria jobs run here."""
    if os.environ.get("PLANARIA_TEST_SHM_CHECK") == "0":
        yield
        return
    before = _shm_files()
    yield
    deadline = time.monotonic() + 10
    while (left := _shm_files() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"left in /dev/shm: {sorted(left)}"


@pytest.fixture(scope="session", autouse=True)
def trace_marker() -> Iterator[str]:
    """This session's marker in os.environ: every process a test starts inherits it."""
    with leftovers.marking() as marker:
        yield marker


@pytest.fixture(autouse=True)
def nothing_left_running(trace_marker: str, no_shm_leak: None) -> Iterator[None]:
    """No test leaves a process running: whatever still carries the session's marker after it
    (allowing processes on their way out a few seconds) is killed and fails the test. It asks
    for ``no_shm_leak`` so that its own check comes first: a leftover holding shared memory is
    named as the process it is."""
    yield
    assert_nothing_left(trace_marker)


@pytest.fixture
def plugin_path(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[str]]:
    """Put committed fake distributions (``tests/fixtures/plugins/NAME``) on ``sys.path`` so that
    their entry points load through importlib.metadata, as an installed package's would."""

    def add(*names: str) -> list[str]:
        paths = [str(PLUGIN_FIXTURES / name) for name in names]
        for path in paths:
            monkeypatch.syspath_prepend(path)
        return paths

    monkeypatch.delenv("PLANARIA_DISABLE_PLUGINS", raising=False)
    return add


def planaria_executable() -> str:
    candidate = Path(sys.executable).parent / "planaria"
    found = str(candidate) if candidate.exists() else shutil.which("planaria")
    assert found, "the planaria console script is not installed"
    return found


@pytest.fixture
def cli(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the real ``planaria`` command in ``tmp_path``; ``plugins=`` adds fixture plugins."""

    def run(
        *args: str, plugins: tuple[str, ...] = (), env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        full_env = {k: v for k, v in os.environ.items() if k != "PLANARIA_DISABLE_PLUGINS"}
        if plugins:
            extra = os.pathsep.join(str(PLUGIN_FIXTURES / p) for p in plugins)
            full_env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [extra, full_env.get("PYTHONPATH")])
            )
        full_env["COLUMNS"] = "200"
        full_env.update(env or {})
        return subprocess.run(
            [planaria_executable(), *args],
            cwd=tmp_path,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    return run
