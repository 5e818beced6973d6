"""planaria-slurm: run planaria jobs on Slurm, one agent per node as a job step.

The names load on first use: ``python -m planaria_slurm.step``, which wraps every node's
agent, must start without importing the scheduler.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["SlurmOptions", "SlurmScheduler"]
_HOME = {"SlurmOptions": "planaria_slurm.options", "SlurmScheduler": "planaria_slurm.scheduler"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'planaria_slurm' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)


if TYPE_CHECKING:
    from planaria_slurm.options import SlurmOptions
    from planaria_slurm.scheduler import SlurmScheduler
