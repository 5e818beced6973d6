"""The built-in ``host`` check passes the health-check conformance suite."""

from __future__ import annotations

import pytest

from planaria.testing import CheckCase, HealthCheckConformance

# Thresholds any node meets, so that a small CI container does not decide the healthy case.
RELAXED = {"min_free_disk": "1MiB", "min_shm": "1MiB", "min_available_memory": "1MiB"}


class TestHostCheck(HealthCheckConformance):
    check_name = "host"
    # Disk, /dev/shm and memory are on every Linux node.
    can_be_not_applicable = False

    @pytest.fixture
    def healthy(self) -> CheckCase:
        return CheckCase(RELAXED)

    @pytest.fixture
    def unhealthy(self) -> CheckCase:
        return CheckCase({**RELAXED, "min_free_disk": "1000TiB"})
