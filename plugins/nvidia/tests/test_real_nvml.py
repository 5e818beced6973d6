"""The check on this machine's real NVML, through pynvml, with no fake in between."""

from __future__ import annotations

import pynvml
import pytest
from real_nvml import DRIVER

from planaria.health.api import CheckContext, Status
from planaria_nvidia import NvidiaCheck, NvidiaOptions
from planaria_nvidia.nvml import Pynvml
from planaria_nvidia.session import NvmlSession, default_session


@pytest.mark.skipif(DRIVER, reason="this machine has an NVIDIA driver")
def test_pynvml_really_raises_library_not_found() -> None:
    with pytest.raises(pynvml.NVMLError_LibraryNotFound) as caught:
        Pynvml().init()
    assert caught.value.value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND


@pytest.mark.skipif(DRIVER, reason="this machine has an NVIDIA driver")
def test_no_driver_is_not_applicable(context: CheckContext) -> None:
    check = NvidiaCheck(NvidiaOptions(expected_devices=8), context)
    assert check.session is default_session()
    (result,) = check.run()
    assert result.device == "nvidia"
    assert result.status is Status.NOT_APPLICABLE
    assert result.detail == (
        "no NVIDIA driver on this node: NVML cannot start (NVML Shared Library Not Found)"
    )
    assert not check.session.started
    # Asked again (the agent checks before every rendezvous), the answer is the same.
    (again,) = NvidiaCheck(NvidiaOptions(), context).run()
    assert again == result


@pytest.mark.skipif(not DRIVER, reason="needs an NVIDIA driver and GPU")
def test_real_gpus(context: CheckContext) -> None:
    session = NvmlSession(Pynvml())
    results = NvidiaCheck(NvidiaOptions(), context, session).run()
    inventory, *gpus = results
    assert inventory.device == "nvidia" and inventory.status is Status.OK, inventory
    assert len(gpus) == int(inventory.metrics["devices"]) >= 1
    for gpu in gpus:
        assert gpu.status is not Status.ERROR, gpu
        assert gpu.metrics["temperature_c"] > 0
        assert gpu.metrics["memory_total_bytes"] > 0
    # Polling the event set a second time never blocks.
    assert session.poll_xids().truncated is False
