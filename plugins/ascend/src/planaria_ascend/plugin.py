"""Registers the ``ascend`` health check through the ``planaria`` entry-point group."""

from __future__ import annotations

from collections.abc import Iterator

from planaria.plugin import hookimpl
from planaria.plugin.records import HealthCheckRecord
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
