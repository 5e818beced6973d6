"""What to type to install a distribution this project publishes (a plugin, an extra of the
core): its name on the package index and, from a checkout, its folder.

The index name alone is not enough: someone who runs planaria from a checkout (the demo's
virtual environment, a development install) may find no such version on their index, or no
such package at all, while the folder next to the code they run always installs it. When
planaria is imported from a checkout, the hint names that checkout's folder and the Python
that runs planaria (a virtual environment that was never activated has no ``pip`` on PATH).
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CORE = "planaria"
PLUGINS = "plugins"


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def checkout() -> Path | None:
    """The root of the checkout this planaria is imported from (its code in ``core/planaria``,
    its plugins in ``plugins/``), or None when it runs from an installed wheel."""
    package = Path(__file__).resolve().parent
    root = package.parent.parent
    inside = package.parent.name == "core" and (root / PLUGINS).is_dir()
    return root if inside and (root / "pyproject.toml").is_file() else None


def layout_folder(distribution: str) -> str:
    """Where this project keeps ``distribution``, relative to a checkout's root: ``.`` for the
    core, ``plugins/custom_script`` for ``planaria-custom-script``."""
    name = _normalize(distribution)
    if name == CORE:
        return "."
    return f"{PLUGINS}/{name.removeprefix(CORE + '-').replace('-', '_')}"


def project_name(folder: Path) -> str | None:
    """The distribution name in ``folder``'s ``pyproject.toml``, or None without one."""
    try:
        data = tomllib.loads((folder / "pyproject.toml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    name = data.get("project", {}).get("name")
    return name if isinstance(name, str) else None


def folder(distribution: str, root: Path) -> Path | None:
    """The folder of ``distribution`` in the checkout at ``root``, if it holds it."""
    where = (root / layout_folder(distribution)).resolve()
    name = project_name(where)
    return where if name is not None and _normalize(name) == _normalize(distribution) else None


def hint(distribution: str, extra: str | None = None) -> str:
    """``pip install planaria-slurm (from this checkout: /venv/bin/python -m pip install -e
    /src/planaria/plugins/slurm)``; with ``extra``, the core's extra (``planaria[report]``)."""
    suffix = f"[{extra}]" if extra else ""
    published = f"pip install {shlex.quote(distribution + suffix)}"
    root = checkout()
    where = folder(distribution, root) if root is not None else None
    if where is None:
        relative = shlex.quote(layout_folder(distribution) + suffix)
        return f"{published} (from a checkout: pip install -e {relative})"
    local = shlex.quote(str(where) + suffix)
    python = shlex.quote(sys.executable or "python")
    return f"{published} (from this checkout: {python} -m pip install -e {local})"
