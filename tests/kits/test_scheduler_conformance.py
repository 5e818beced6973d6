"""The built-in ``local`` scheduler passes the scheduler conformance suite."""

from __future__ import annotations

import pytest

from planaria.scheduler.local import LocalOptions, LocalScheduler
from planaria.testing import SchedulerConformance


class TestLocalScheduler(SchedulerConformance):
    """Every node on a host of its own (``hosts: 0``)."""

    @pytest.fixture
    def scheduler(self) -> LocalScheduler:
        return LocalScheduler(LocalOptions(stop_grace=0.5))


class TestLocalSchedulerSharedHosts(SchedulerConformance):
    """Nodes cycle through two virtual hosts: excluding one leaves one."""

    @pytest.fixture
    def scheduler(self) -> LocalScheduler:
        return LocalScheduler(LocalOptions(hosts=2, stop_grace=0.5))
