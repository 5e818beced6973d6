"""Every ``planaria`` command the README shows in a bash block runs as shown and succeeds, and
every one it shows at all exists, with the plugins it needs, after ``examples/demo.sh``."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support.demo_env import demo_distributions, demo_environment, missing_requirements

ROOT = Path(__file__).resolve().parents[2]
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


SHOWN = re.compile(r"```(bash|text|console)\n(.*?)```", re.DOTALL)
CONFIG_SUFFIXES = (".yaml", ".yml", ".toml")


def shown_commands() -> list[list[str]]:
    """Every ``planaria`` command the README shows, run by the test above or only shown (a
    ``text`` block for a cluster, a ``console`` session), as words; each part of a pipeline
    or ``&&`` chain on its own."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for kind, block in SHOWN.findall(text):
        block = re.sub(r"\\\n", " ", block)  # a line continued by a backslash is one command
        for line in block.splitlines():
            line = line.strip()
            if kind == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            for part in re.split(r"&&|\|", line):
                words = shlex.split(part, comments=True)
                if "planaria" in words:  # also a launcher's: srun ... planaria run ...
                    commands.append(words[words.index("planaria") + 1 :])
    return commands


def command_path(words: list[str]) -> tuple[str, ...]:
    """``config validate examples/check.yaml`` -> ``("config", "validate")``: the command, and
    the command of its group (the core's ``config``, a plugin's ``kubernetes``)."""
    import typer.main

    from planaria.cli.entry import app

    core: Any = typer.main.get_command(app)
    first = core.commands.get(words[0])
    if first is not None and not hasattr(first, "commands"):  # a command, not a group
        return (words[0],)
    return tuple(words[:2])


def shown_config_files() -> list[str]:
    return sorted(
        {
            word
            for words in shown_commands()
            for word in words
            if word.endswith(CONFIG_SUFFIXES) and (ROOT / word).is_file()
        }
    )


def test_the_readme_shows_commands_of_plugins_and_their_files():
    paths = {command_path(words) for words in shown_commands()}
    assert {("kubernetes", "manifest"), ("submit",), ("config", "validate"), ("check",)} <= paths
    assert {"examples/check.yaml", "examples/kubernetes.yaml", "examples/slurm.yaml"} <= set(
        shown_config_files()
    )


def test_the_demo_installs_the_plugins_that_need_no_system_of_their_own():
    assert demo_distributions() == {
        "planaria",
        "planaria-custom-script",
        "planaria-fsspec",
        "planaria-slurm",
        "planaria-kubernetes",
    }


@pytest.fixture(scope="module")
def demo_env(tmp_path_factory):
    return demo_environment(tmp_path_factory.mktemp("demo-site"))


def _in_demo_env(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["planaria", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "path", sorted({command_path(words) for words in shown_commands()}), ids=" ".join
)
def test_each_shown_command_exists_after_the_demo(path, demo_env):
    """Each command the README shows is one that ``planaria`` has with the demo's install:
    ``--help`` is answered by the command itself (a missing command or plugin exits 2)."""
    result = _in_demo_env([*path, "--help"], demo_env, ROOT)
    assert result.returncode == 0, f"planaria {' '.join(path)}\n{result.stdout}\n{result.stderr}"
    assert "Usage: planaria " + path[0] in " ".join(result.stdout.split())


@pytest.mark.parametrize("config", shown_config_files())
def test_each_shown_config_file_resolves_after_the_demo(config, demo_env):
    """Every plugin the README's example files name is one the demo installs."""
    result = _in_demo_env(["config", "validate", config], demo_env, ROOT)
    for module, plugin in missing_requirements().items():
        if f"No module named '{module}'" in result.stderr:
            pytest.skip(f"{module}, which the demo installs with {plugin}, is not installed here")
    assert result.returncode == 0, f"{config}\n{result.stdout}\n{result.stderr}"
    assert "valid" in result.stdout


def test_a_plugin_left_out_of_the_demo_is_missing_in_its_environment(demo_env, tmp_path):
    """The environment above is no wider than the demo's: ray, which it leaves out, is not
    there, and the error says how to install it from this checkout."""
    job = tmp_path / "ray.yaml"
    job.write_text("job: {command: python -c pass}\nscheduler: {backend: ray}\n")
    result = _in_demo_env(["config", "validate", str(job)], demo_env, tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    said = " ".join(result.stderr.split())
    assert "pip install planaria-ray" in said or "disabled" in said, said
