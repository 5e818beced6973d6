"""Every ``planaria`` command the README shows in a bash block runs as shown and succeeds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"```bash\n(.*?)```", re.DOTALL)


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    lines = [line.strip() for block in BLOCK.findall(text) for line in block.splitlines()]
    return [line for line in lines if line.startswith("planaria ")]


def test_readme_shows_planaria_commands():
    assert len(readme_commands()) >= 6


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_runs(command, tmp_path):
    # Run where the README's relative paths resolve, without writing into the checkout.
    for name in ("examples", "plugins"):
        (tmp_path / name).symlink_to(ROOT / name)
    bin_dir = Path(sys.executable).parent  # where this environment's console scripts live
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {command}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
