"""The old homes of public names that moved: a plugin written against them keeps working for a
minor version, warned (:class:`DeprecationWarning`) where each name lives now.

An old home's ``__getattr__`` calls :func:`forward`: the old module holds nothing itself and
fetches a moved name from its new module when asked for it, so importing it loads no more than
before.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping

PUBLIC = "planaria.plugin"


def forward(old: str, moves: Mapping[str, tuple[str, ...]], name: str) -> object:
    """``name`` of module ``old`` (called from its ``__getattr__``), where ``moves`` map each
    new module to the names that moved there from ``old``."""
    new = next((module for module, names in moves.items() if name in names), None)
    if new is None:
        raise AttributeError(f"module {old!r} has no attribute {name!r}")
    public: tuple[str, ...] = getattr(importlib.import_module(PUBLIC), "__all__", ())
    where = f"from {PUBLIC}, its public home" if name in public else "from there"
    warnings.warn(
        f"{old}.{name} moved to {new}: import it {where}; {old}.{name} goes in the next "
        "minor version",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(importlib.import_module(new), name)
