"""A module of the core or of a plugin over 400 lines says at its top why it is one idea.

Size is not the fault; a module that mixes ideas is. Past 400 lines a reader should not have to
find out alone whether a module holds one idea or several: its docstring says, in a paragraph
that starts "Why one module:", what keeps it whole (or it is split).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 400
REASON = "Why one module:"


def _modules() -> list[Path]:
    found = list((ROOT / "core" / "planaria").rglob("*.py"))
    for plugin in sorted((ROOT / "plugins").iterdir()):
        found += list((plugin / "src").rglob("*.py"))
    return sorted(p for p in found if "egg-info" not in p.as_posix())


def test_the_modules_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in _modules()}
    assert "core/planaria/scheduler/engine.py" in names
    assert "plugins/slurm/src/planaria_slurm/scheduler.py" in names


def test_every_module_over_400_lines_says_why_it_is_one() -> None:
    unexplained = []
    for path in _modules():
        text = path.read_text()
        lines = text.count("\n")
        if lines <= LIMIT:
            continue
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if REASON not in docstring:
            unexplained.append(f"{path.relative_to(ROOT)} ({lines} lines)")
    assert not unexplained, (
        f"modules over {LIMIT} lines whose docstring does not say {REASON!r} (split them, or "
        f"say what keeps each one idea): {unexplained}"
    )
