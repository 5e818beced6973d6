"""No import cycles in the ``planaria`` package, the plugins' packages and the benchmarks.

Every module is read with :mod:`ast` (not imported): imports at the top, inside functions and
under ``if TYPE_CHECKING`` all count, since each is a dependency a reader has to follow. A cycle
is a strongly connected component of more than one module; the test lists every one it finds.
The packages make one graph, so a circle through two of them (the core importing a plugin that
imports the core) is found too.

A benchmark is run as a script (``python benchmarks/NAME.py``), which puts ``benchmarks/`` on
``sys.path``: a sibling imported by its bare name there would be a second copy of a module of
the package (or of ``__main__``) and an edge this graph cannot see, so benchmarks import each
other only through the package.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def packages() -> dict[str, Path]:
    """Every package of the repository: the core, each plugin's and the benchmarks."""
    found = {"planaria": ROOT / "core" / "planaria", "benchmarks": BENCHMARKS}
    for init in sorted(ROOT.glob("plugins/*/src/*/__init__.py")):
        found[init.parent.name] = init.parent
    return found


def modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``root`` (a package)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _targets(
    node: ast.AST, name: str, is_package: bool, known: Mapping[str, Path]
) -> Iterator[str]:
    """The modules of ``known`` that one import statement in module ``name`` depends on."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    assert isinstance(node, ast.ImportFrom)
    if node.level:  # relative: from the module's own package, up level - 1 packages
        here = name.split(".") if is_package else name.split(".")[:-1]
        base = here[: len(here) - (node.level - 1)]
        origin = ".".join([*base, node.module] if node.module else base)
    else:
        origin = node.module or ""
    for alias in node.names:
        submodule = f"{origin}.{alias.name}"
        # ``from a.b import c``: the submodule a.b.c if there is one, else a name in a.b.
        yield submodule if submodule in known else origin


def import_graph(roots: Mapping[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules it imports, of the packages of ``roots`` (name -> directory)."""
    known = {
        name: path
        for package, root in roots.items()
        for name, path in modules(root, package).items()
    }
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges = graph.setdefault(name, set())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                is_package = path.name == "__init__.py"
                edges.update(t for t in _targets(node, name, is_package, known) if t in known)
        edges.discard(name)
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative so
    that a deep package cannot overflow the stack), each sorted, sorted by their first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def describe(graph: Mapping[str, set[str]], component: list[str]) -> str:
    """One cycle, with the imports that make it (only those between its members)."""
    members = set(component)
    edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return f"{', '.join(component)}\n    " + "\n    ".join(edges)


def test_the_packages_have_no_import_cycle():
    found_packages = packages()
    assert {"planaria_slurm", "planaria_ray", "planaria_nvidia"} <= set(found_packages)
    graph = import_graph(found_packages)
    assert "planaria.master.job" in graph and "planaria.cli.run" in graph
    assert "planaria.protocol" in graph["planaria_slurm.scheduler"]
    assert "benchmarks.harness" in graph["benchmarks.recovery_slurm"]
    found = cycles(graph)
    assert not found, f"{len(found)} import cycle(s):\n" + "\n".join(
        describe(graph, c) for c in found
    )


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_every_cycle_is_found_whatever_form_its_imports_take(tmp_path):
    root = tmp_path / "pkg"
    _write(
        root,
        {
            "__init__.py": "",
            "a.py": "from pkg import b\n",  # a submodule named in a from-import
            "b.py": "def f():\n    from .sub.c import X\n    return X\n",  # inside a function
            "sub/__init__.py": "from . import c\n",  # relative, from a package's __init__
            "sub/c.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\nX = 1\n"
            ),
            "d.py": "from pkg.e import VALUE\n",  # a name, not a submodule: an edge to pkg.e
            "e.py": "from .. import outside\nimport pkg.d as d\nVALUE = 1\n",
            "lone.py": "import pkg.a\nfrom pkg import lone\n",  # imports itself: no cycle
        },
    )
    graph = import_graph({"pkg": root})
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.sub"] == {"pkg.sub.c"}
    assert graph["pkg.lone"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"], ["pkg.d", "pkg.e"]]
    text = describe(graph, ["pkg.d", "pkg.e"])
    assert "pkg.d -> pkg.e" in text and "pkg.e -> pkg.d" in text


def test_a_package_without_cycles_passes(tmp_path):
    root = tmp_path / "pkg"
    _write(root, {"__init__.py": "", "a.py": "import pkg.b\n", "b.py": "import os\n"})
    assert cycles(import_graph({"pkg": root})) == []


def bare_sibling_imports(root: Path) -> list[str]:
    """Imports in the modules of package ``root`` that name a module of it by its bare name
    (``import recovery``, ``from harness import X``) rather than through the package."""
    siblings = {path.stem for path in root.glob("*.py")} | {
        path.parent.name for path in root.glob("*/__init__.py")
    }
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            found += [
                f"{path.relative_to(root.parent)}:{node.lineno}: {name}"
                for name in names
                if name.split(".")[0] in siblings
            ]
    return found


def test_benchmarks_import_each_other_only_through_the_package():
    assert bare_sibling_imports(BENCHMARKS) == []


def test_a_bare_import_of_a_sibling_is_found(tmp_path):
    root = tmp_path / "bench"
    _write(
        root,
        {
            "__init__.py": "",
            "harness.py": "import os\n",
            "one.py": "import harness\nfrom bench import harness as h\n",
            "two.py": "def f():\n    from harness import X\n    import one.sub\n",
        },
    )
    assert bare_sibling_imports(root) == [
        "bench/one.py:1: harness",
        "bench/two.py:2: harness",
        "bench/two.py:3: one.sub",
    ]


def test_a_circle_through_two_packages_is_found(tmp_path):
    _write(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/api.py": "def f():\n    import plugin.impl\n",  # the core reaching a plugin
            "plugin/__init__.py": "",
            "plugin/impl.py": "from core.api import f\n",
        },
    )
    graph = import_graph({"core": tmp_path / "core", "plugin": tmp_path / "plugin"})
    assert cycles(graph) == [["core.api", "plugin.impl"]]


@pytest.mark.parametrize("size", [3, 2000])
def test_a_long_chain_closing_on_itself_is_one_cycle(size):
    graph = {f"m{i}": {f"m{(i + 1) % size}"} for i in range(size)}
    (component,) = cycles(graph)
    assert len(component) == size
