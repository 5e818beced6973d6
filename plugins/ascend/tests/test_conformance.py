"""``ascend`` passes the health-check conformance suite, with fake npu-smi executables."""

from __future__ import annotations

import pytest
from conftest import FakeNpuSmi

from planaria.testing import CheckCase, HealthCheckConformance


class TestAscend(HealthCheckConformance):
    check_name = "ascend"
    can_hang = True
    can_be_undecidable = True

    @pytest.fixture
    def healthy(self, fake_npu_smi: FakeNpuSmi) -> CheckCase:
        fake_npu_smi()
        return CheckCase({"expected_devices": 8})

    @pytest.fixture
    def unhealthy(self, fake_npu_smi: FakeNpuSmi) -> CheckCase:
        fake_npu_smi(ecc={3: "ecc_double_bit.txt"})
        return CheckCase({})

    @pytest.fixture
    def not_applicable(self) -> CheckCase:
        # The autouse `no_tools` fixture leaves no npu-smi on PATH, and torch_npu is absent.
        return CheckCase({})

    @pytest.fixture
    def hanging(self, fake_npu_smi: FakeNpuSmi) -> CheckCase:
        fake_npu_smi(hang=True)
        # The query's own limit is far off: the runner's timeout comes first and cancels it.
        return CheckCase({"command_timeout": "10m"})

    @pytest.fixture
    def undecidable(self, fake_npu_smi: FakeNpuSmi) -> CheckCase:
        fake_npu_smi(info="garbage.txt")
        return CheckCase({})
