from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = [
    "planaria.testing.leaks",
    "planaria.testing.jobs",
    "support.scheduler",
    "support.netns",
]
"""After every test, nothing it started still runs and nothing it created is left in /dev/shm
(``leaks``); the ``mark`` fixture of the job harness (``jobs``); the local scheduler's
``harness`` fixture (``support.scheduler``); network namespaces (``support.netns``)."""

FIXTURES = Path(__file__).parent / "fixtures"
PLUGIN_FIXTURES = FIXTURES / "plugins"
END_TO_END = ("e2e", "benchmarks")
"""The layers whose tests run whole jobs or benchmarks: marked ``e2e``, out of the fast loop."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        relative = item.path.relative_to(here) if item.path.is_relative_to(here) else None
        if relative is not None and relative.parts[0] in END_TO_END:
            item.add_marker(pytest.mark.e2e)


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


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs: a real "No space left on device"."""
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Any]:
    """What an agent does for the flash checkpoint, played by the test
    (:class:`support.checkpoints.Node`: a persister and its managed workers); closed after."""
    from support.checkpoints import Node  # torch: only for the tests that take it

    created = Node(tmp_path, tmp_path / "ckpt")
    try:
        yield created
    finally:
        created.close()
