"""``nvidia`` passes the health-check conformance suite, on recorded NVML answers."""

from __future__ import annotations

from typing import Any

import pytest
from fake_nvml import FakeNvml

from planaria.health.api import CheckContext
from planaria.testing import CheckCase, HealthCheckConformance
from planaria_nvidia import NvidiaCheck
from planaria_nvidia.session import NvmlSession


def on(fixture: str) -> Any:
    """A factory of checks that talk to a fake NVML answering as ``fixture`` records."""

    def make(options: Any, context: CheckContext) -> NvidiaCheck:
        return NvidiaCheck(options, context, session=NvmlSession(FakeNvml(fixture)))

    return make


class TestNvidia(HealthCheckConformance):
    check_name = "nvidia"
    # NVML answers at once (XID events are polled with a zero timeout): nothing to hang on.
    can_hang = False
    can_be_undecidable = True

    @pytest.fixture
    def healthy(self) -> CheckCase:
        return CheckCase({"expected_devices": 8}, factory=on("healthy_h100.json"))

    @pytest.fixture
    def unhealthy(self) -> CheckCase:
        return CheckCase({}, factory=on("ecc_uncorrectable.json"))

    @pytest.fixture
    def not_applicable(self) -> CheckCase:
        return CheckCase({}, factory=on("driver_not_loaded.json"))

    @pytest.fixture
    def undecidable(self) -> CheckCase:
        return CheckCase({}, factory=on("version_mismatch.json"))
