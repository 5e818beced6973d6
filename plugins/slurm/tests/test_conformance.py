"""The ``slurm`` scheduler passes the scheduler conformance suite on a real Slurm cluster: every
node is a job step of an allocation of 4 nodes (all on this machine, so /proc shows them)."""

from __future__ import annotations

import pytest
from planaria_slurm import SlurmOptions, SlurmScheduler

from planaria.testing import SchedulerConformance


class TestSlurmScheduler(SchedulerConformance):
    @pytest.fixture
    def scheduler(self, allocation: str) -> SlurmScheduler:
        return SlurmScheduler(SlurmOptions(job_id=allocation, stop_grace=0.5, watch_interval=0.5))
