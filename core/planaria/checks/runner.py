"""The old home of the health-check runner, now :mod:`planaria.health.runner` (a plugin's tests
run a check through :class:`planaria.testing.health.HealthCheckConformance`)."""

from __future__ import annotations

from planaria.moved import forward

_MOVED = {"planaria.health.runner": ("ConfiguredCheck", "run_checks")}


def __getattr__(name: str) -> object:
    return forward(__name__, _MOVED, name)
