"""Fixtures: the context a check runs in, and checks wired to a fake NVML session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fake_nvml import FakeNvml

from planaria.health.api import CheckContext, DeviceResult
from planaria_nvidia import NvidiaCheck, NvidiaOptions
from planaria_nvidia.session import NvmlSession

RunFake = Callable[..., tuple[dict[str, DeviceResult], FakeNvml]]


@pytest.fixture
def context(tmp_path: Path) -> CheckContext:
    return CheckContext(node="gpu-node-3", workdir=tmp_path)


@pytest.fixture
def run_fake(context: CheckContext) -> RunFake:
    """``run_fake("xid_fatal.json", max_temperature=80)`` -> (results by device, the fake)."""

    def run(fixture: str, **options: Any) -> tuple[dict[str, DeviceResult], FakeNvml]:
        fake = FakeNvml(fixture)
        check = NvidiaCheck(NvidiaOptions(**options), context, session=NvmlSession(fake))
        results = check.run()
        by_device = {r.device: r for r in results}
        assert len(by_device) == len(results), "two results for one device"
        return by_device, fake

    return run
