"""The project stands on aiohttp's public API only: no attribute aiohttp keeps private (one it
names with a leading underscore) is read or written anywhere in the code, its tests or its
benchmarks, and nothing private of aiohttp is imported. An aiohttp upgrade can then change
only what aiohttp documents."""

from __future__ import annotations

import ast
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
OURS = [ROOT / "core", ROOT / "plugins", ROOT / "tests", ROOT / "benchmarks", ROOT / "examples"]


def _private(names: set[str], tree: ast.AST) -> None:
    """The private attribute names ``tree`` defines: ``self._x = ...``, class-level ``_x``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                targets = []
                if isinstance(item, ast.Assign):
                    targets = item.targets
                elif isinstance(item, ast.AnnAssign):
                    targets = [item.target]
                elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Assign) and any(  # __slots__ = ("_x", ...)
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            for value in ast.walk(node.value):
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    names.add(value.value)


def _own_attributes(tree: ast.AST) -> dict[int, set[str]]:
    """For each ``self.x`` inside a class that derives from one of aiohttp's (a base written
    ``web.X`` or ``aiohttp.X``): the names that class defines itself, by the node's id."""
    found: dict[int, set[str]] = {}
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        bases = [ast.unparse(b) for b in cls.bases]
        if not any(b.startswith(("web.", "aiohttp.")) for b in bases):
            continue
        defined: set[str] = set()
        _private(defined, cls)
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute):
                found[id(node)] = defined
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _files(roots: list[Path]) -> list[Path]:
    return [p for root in roots for p in root.rglob("*.py") if ".tox" not in p.parts]


def test_no_private_attribute_or_module_of_aiohttp_is_used() -> None:
    theirs: set[str] = set()
    for path in Path(aiohttp.__file__).parent.rglob("*.py"):
        _private(theirs, ast.parse(path.read_text()))
    theirs = {n for n in theirs if _is_private(n)}
    assert "_loop" in theirs and "_server" in theirs  # the walk sees what aiohttp keeps

    ours: set[str] = set()
    trees = {path: ast.parse(path.read_text()) for path in _files(OURS)}
    for tree in trees.values():
        _private(ours, tree)

    found = []
    for path, tree in trees.items():
        where = path.relative_to(ROOT)
        mine = _own_attributes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                if on_self:
                    # Inside a class of ours: aiohttp's only where the class is one of aiohttp's
                    # and does not define the name itself.
                    base = mine.get(id(node))
                    if base is not None and node.attr in theirs and node.attr not in base:
                        found.append(f"{where}:{node.lineno}: self.{node.attr}")
                elif node.attr in theirs and node.attr not in ours:
                    # A name aiohttp keeps private that no code of ours defines: aiohttp's state.
                    found.append(f"{where}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("aiohttp"):
                module = node.module or ""
                private = [a.name for a in node.names if _is_private(a.name)]
                if any(_is_private(part) for part in module.split(".")) or private:
                    found.append(f"{where}:{node.lineno}: from {module} import {private}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == "aiohttp" and any(_is_private(p) for p in parts):
                        found.append(f"{where}:{node.lineno}: import {alias.name}")
    assert not found, "aiohttp's private state used:\n" + "\n".join(found)
