"""The ``ray`` scheduler passes the scheduler conformance suite on a real Ray cluster of four
nodes (a head and three raylets, all on this machine, so /proc shows the actors' processes)."""

from __future__ import annotations

import pytest

from planaria.testing import SchedulerConformance
from planaria_ray import RayOptions, RayScheduler


class TestRayScheduler(SchedulerConformance):
    @pytest.fixture
    def scheduler(self, ray_address: str) -> RayScheduler:
        return RayScheduler(RayOptions(address=ray_address, stop_grace=0.5))
