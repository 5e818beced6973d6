"""The loadavg check passes planaria's health-check conformance suite.

Run it once the plugin is installed: ``pip install -e .[test] && pytest``. The suite finds the
check by its entry-point name, so these tests also prove that the entry point registers it.
"""

from __future__ import annotations

import os

import pytest

from planaria.testing import CheckCase, HealthCheckConformance


class TestLoadavg(HealthCheckConformance):
    check_name = "loadavg"
    can_be_undecidable = True
    can_be_degraded = True

    @pytest.fixture
    def healthy(self) -> CheckCase:
        return CheckCase({"max_load_per_cpu": 1000, "degraded_load_per_cpu": 1000})

    @pytest.fixture
    def unhealthy(self) -> CheckCase:
        if os.getloadavg()[0] == 0.0:
            pytest.skip("the 1-minute load average is exactly 0 on this machine")
        return CheckCase({"max_load_per_cpu": 1e-9, "degraded_load_per_cpu": 1e-9})

    @pytest.fixture
    def degraded(self) -> CheckCase:
        if os.getloadavg()[0] == 0.0:
            pytest.skip("the 1-minute load average is exactly 0 on this machine")
        return CheckCase({"max_load_per_cpu": 1000, "degraded_load_per_cpu": 1e-9})

    @pytest.fixture
    def not_applicable(self, monkeypatch: pytest.MonkeyPatch) -> CheckCase:
        # As on a platform without os.getloadavg (Windows).
        monkeypatch.delattr(os, "getloadavg")
        return CheckCase({})

    @pytest.fixture
    def undecidable(self, monkeypatch: pytest.MonkeyPatch) -> CheckCase:
        # As where the number of CPUs cannot be told.
        monkeypatch.setattr(os, "cpu_count", lambda: None)
        return CheckCase({})
