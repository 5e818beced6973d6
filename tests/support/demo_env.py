"""The plugins ``examples/demo.sh`` installs, and an environment that holds those and no other:
the README's commands are checked against what a user has after the demo.

A real ``pip install`` of each plugin needs an index and minutes; instead each plugin's entry
points, as its own ``pyproject.toml`` declares them, are written to a ``*.dist-info`` folder put
first on ``PYTHONPATH`` with the plugin's source, the way an editable install finds them. The
plugins' third-party requirements must be installed in the running environment (fsspec is; the
kubernetes client is imported only when a cluster is asked, which no README command does
here). Plugins of this checkout that the demo leaves out are disabled by name, so that one
installed in the test environment does not make a command pass that fails after the demo.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

from planaria import install

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "demo.sh"


def demo_folders() -> list[Path]:
    """The folders the demo's ``pip install`` installs (``-e FOLDER``), extras dropped."""
    words = shlex.split(DEMO.read_text().replace("\\\n", " "), comments=True)
    start = words.index("install")
    folders = []
    for flag, value in zip(words[start:], words[start + 1 :], strict=False):
        if flag == "-e":
            folders.append((ROOT / re.sub(r"\[.*\]$", "", value)).resolve())
    return folders


def demo_distributions() -> set[str]:
    """The distribution names of :func:`demo_folders` (``planaria``, ``planaria-slurm`` ...)."""
    names = {install.project_name(folder) for folder in demo_folders()}
    assert None not in names, f"the demo installs a folder without a project: {demo_folders()}"
    return {name for name in names if name is not None}


def _entry_points(pyproject: Path) -> dict[str, str]:
    data = tomllib.loads(pyproject.read_text())
    return dict(data["project"].get("entry-points", {}).get("planaria", {}))


def demo_environment(where: Path) -> dict[str, str]:
    """The environment variables of a process that sees the demo's plugins and no other plugin
    of this checkout; ``where`` receives the ``*.dist-info`` folders."""
    chosen = [folder for folder in demo_folders() if folder != ROOT]
    paths = [str(where), str(ROOT / "core")]
    for folder in chosen:
        name = install.project_name(folder)
        assert name is not None
        info = where / f"{name.replace('-', '_')}-0.1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
        lines = ["[planaria]"] + [
            f"{k} = {v}" for k, v in _entry_points(folder / "pyproject.toml").items()
        ]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        paths.append(str(folder / "src"))
    left_out = [
        key
        for pyproject in sorted(ROOT.glob("plugins/*/pyproject.toml"))
        if pyproject.parent.resolve() not in chosen
        for key in _entry_points(pyproject)
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PLANARIA_DISABLE_PLUGINS"] = ",".join(left_out)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def missing_requirements() -> dict[str, str]:
    """The requirements of the demo's plugins that this environment lacks (which the demo's
    ``pip install`` would bring): ``{"kubernetes": "planaria-kubernetes"}``."""
    from importlib.metadata import PackageNotFoundError, distribution

    missing = {}
    for folder in demo_folders():
        data = tomllib.loads((folder / "pyproject.toml").read_text())
        for requirement in data["project"].get("dependencies", []):
            name = re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]
            if name == install.CORE:
                continue
            try:
                distribution(name)
            except PackageNotFoundError:
                missing[name] = data["project"]["name"]
    return missing
