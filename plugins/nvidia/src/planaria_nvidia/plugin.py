"""Registers the ``nvidia`` health check and the NVIDIA fault patterns (driver Xids, CUDA and
NCCL errors) through the ``planaria`` entry-point group."""

from __future__ import annotations

from collections.abc import Iterator

from planaria.plugin import FaultPattern, HealthCheckRecord, hookimpl
from planaria_nvidia.check import NvidiaCheck
from planaria_nvidia.options import NvidiaOptions
from planaria_nvidia.patterns import PATTERNS


@hookimpl
def planaria_health_checks() -> Iterator[HealthCheckRecord]:
    yield HealthCheckRecord(
        name="nvidia",
        factory=NvidiaCheck,
        options=NvidiaOptions,
        summary="NVIDIA GPUs through NVML: count, ECC, row remapping, XID events, throttling, "
        "temperature, NVLink errors",
    )


@hookimpl
def planaria_fault_patterns() -> list[FaultPattern]:
    return list(PATTERNS)
