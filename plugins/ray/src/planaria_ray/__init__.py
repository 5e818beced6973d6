"""planaria-ray: run planaria jobs on a Ray cluster, one agent per Ray node as an actor.

The names load on first use, so that ``planaria plugins`` lists the plugin without importing
Ray (a second or more).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["RayOptions", "RayScheduler"]
_HOME = {"RayOptions": "planaria_ray.options", "RayScheduler": "planaria_ray.scheduler"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'planaria_ray' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)


if TYPE_CHECKING:
    from planaria_ray.options import RayOptions
    from planaria_ray.scheduler import RayScheduler
