"""Helpers that run ``planaria`` commands the way a user does: ``planaria status``, a config
file loaded for its problems."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planaria.config import load
from planaria.errors import ConfigError


def status(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PLANARIA, "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def status_json(*args: str, env: dict[str, str] | None = None) -> dict:
    result = status(*args, "--json", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def problems(tmp_path: Path, text: str, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        load(write(tmp_path, text), overrides)
    return [str(issue) for issue in exc.value.issues]


PLANARIA = str(Path(sys.executable).parent / "planaria")


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path
