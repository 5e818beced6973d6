"""Registers the ``ascend`` health check and the HCCL fault pattern through the ``planaria``
entry-point group."""

from __future__ import annotations

from collections.abc import Iterator

from planaria.plugin import FaultPattern, HealthCheckRecord, hookimpl
from planaria_ascend.check import AscendCheck
from planaria_ascend.options import AscendOptions


@hookimpl
def planaria_health_checks() -> Iterator[HealthCheckRecord]:
    yield HealthCheckRecord(
        name="ascend",
        factory=AscendCheck,
        options=AscendOptions,
        summary="Huawei Ascend NPUs through torch_npu and npu-smi: presence, health, ECC, "
        "temperature",
    )


@hookimpl
def planaria_fault_patterns() -> FaultPattern:
    # A collective that failed (a lost peer, a timeout): a restart in place cures it. A timeout
    # given a value ("timeout: 1800", "timeout=1800", a printed config) is a setting, no event.
    return FaultPattern(
        pattern=r"(?i)\bhccl\b.*(?:error|fail|timed out|\btimeout\b(?!\s*[:=]))",
        kind="transient",
        reason="HCCL error",
    )
