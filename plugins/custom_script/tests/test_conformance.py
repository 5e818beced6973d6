"""``custom_script`` passes the health-check conformance suite, with real scripts."""

from __future__ import annotations

import pytest
from custom_script_helpers import MakeScript

from planaria.testing import CheckCase, HealthCheckConformance


class TestCustomScript(HealthCheckConformance):
    check_name = "custom_script"
    can_hang = True
    can_be_undecidable = True
    can_be_degraded = True

    @pytest.fixture
    def healthy(self, make_script: MakeScript) -> CheckCase:
        line = '{"device": "chip0", "status": "ok", "detail": "41 C", "metrics": {"temp_c": 41}}'
        script = make_script(f"echo '{line}'")
        return CheckCase({"path": str(script)})

    @pytest.fixture
    def unhealthy(self, make_script: MakeScript) -> CheckCase:
        script = make_script(
            """
echo '{"device": "chip0", "status": "failed", "detail": "HBM ECC count 12 above 0"}'
exit 1
"""
        )
        return CheckCase({"path": str(script)})

    @pytest.fixture
    def degraded(self, make_script: MakeScript) -> CheckCase:
        line = '{"device": "chip0", "status": "degraded", "detail": "clock throttled to 60%"}'
        return CheckCase({"path": str(make_script(f"echo '{line}'"))})

    @pytest.fixture
    def not_applicable(self, make_script: MakeScript) -> CheckCase:
        script = make_script(
            """echo '{"device": "chip", "status": "not_applicable", "detail": "no chip driver"}'"""
        )
        return CheckCase({"path": str(script)})

    @pytest.fixture
    def hanging(self, make_script: MakeScript) -> CheckCase:
        # The script's own timeout is far off: the runner's comes first and cancels it.
        return CheckCase({"path": str(make_script("sleep 600 & wait")), "timeout": "10m"})

    @pytest.fixture
    def undecidable(self, make_script: MakeScript) -> CheckCase:
        return CheckCase({"path": str(make_script("echo 'GPU 0: fine, I think'"))})
