"""Registers the ``nvidia`` health check through the ``planaria`` entry-point group."""

from __future__ import annotations

from collections.abc import Iterator

from planaria.plugin import hookimpl
from planaria.plugin.records import HealthCheckRecord
from planaria_nvidia.check import NvidiaCheck
from planaria_nvidia.options import NvidiaOptions


@hookimpl
def planaria_health_checks() -> Iterator[HealthCheckRecord]:
    yield HealthCheckRecord(
        name="nvidia",
        factory=NvidiaCheck,
        options=NvidiaOptions,
        summary="NVIDIA GPUs through NVML: count, ECC, row remapping, XID events, throttling, "
        "temperature, NVLink errors",
    )
