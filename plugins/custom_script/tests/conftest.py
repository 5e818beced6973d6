"""Fixtures: real executable scripts written into tmp_path, and the context a check runs in."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from custom_script_helpers import MakeScript

from planaria.health.api import CheckContext


@pytest.fixture
def make_script(tmp_path: Path) -> MakeScript:
    """``make_script(body, name="check.sh")`` writes an executable bash script."""

    def make(body: str, name: str = "check.sh", shebang: str = "#!/bin/bash") -> Path:
        path = tmp_path / name
        path.write_text(f"{shebang}\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return path

    return make


@pytest.fixture
def context(tmp_path: Path) -> CheckContext:
    workdir = tmp_path / "work"
    workdir.mkdir()
    return CheckContext(node="node-7", workdir=workdir)
