"""The ``loadavg`` health check: the 1-minute load average per CPU, against two thresholds.

A node whose CPUs are already saturated (data loaders of a previous job, a runaway process)
trains slowly; this check marks it ``degraded`` or ``failed`` before training starts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Everything a health-check plugin needs comes from planaria.plugin.
from planaria.plugin import (
    DeviceResult,
    HealthCheck,
    HealthCheckError,
    HealthCheckRecord,
    Status,
    hookimpl,
)


class LoadavgOptions(BaseModel):
    """Thresholds on the 1-minute load average divided by the number of CPUs."""

    # Required by planaria: an unknown key (a typo) must be an error, not silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_load_per_cpu: float = Field(default=4.0, gt=0, description="failed above this")
    degraded_load_per_cpu: float = Field(default=2.0, gt=0, description="degraded above this")

    @model_validator(mode="after")
    def _ordered(self) -> LoadavgOptions:
        if self.degraded_load_per_cpu > self.max_load_per_cpu:
            raise ValueError(
                f"degraded_load_per_cpu ({self.degraded_load_per_cpu:g}) must not be greater "
                f"than max_load_per_cpu ({self.max_load_per_cpu:g})"
            )
        return self


class LoadavgCheck(HealthCheck[LoadavgOptions]):
    def run(self) -> list[DeviceResult]:
        getloadavg = getattr(os, "getloadavg", None)  # absent on Windows
        try:
            if getloadavg is None:
                raise OSError("os.getloadavg is not available on this platform")
            load1, load5, load15 = getloadavg()
        except OSError as exc:
            # Nothing to measure here: "not applicable", never a crash.
            return [DeviceResult(device="cpu", status=Status.NOT_APPLICABLE, detail=str(exc))]

        cpus = os.cpu_count()
        if not cpus:
            # The check cannot reach a verdict: the runner reports it as "error".
            raise HealthCheckError("cannot tell how many CPUs this node has")

        per_cpu = load1 / cpus
        opts = self.options
        if per_cpu > opts.max_load_per_cpu:
            status, limit = Status.FAILED, f"above the maximum {opts.max_load_per_cpu:g}"
        elif per_cpu > opts.degraded_load_per_cpu:
            status, limit = Status.DEGRADED, f"above {opts.degraded_load_per_cpu:g}"
        else:
            status, limit = Status.OK, f"maximum {opts.max_load_per_cpu:g}"
        return [
            DeviceResult(
                device="cpu",
                status=status,
                detail=f"load {load1:.2f} on {cpus} CPUs: {per_cpu:.2f} per CPU ({limit})",
                metrics={
                    "load_1m": load1,
                    "load_5m": load5,
                    "load_15m": load15,
                    "cpus": float(cpus),
                    "load_per_cpu": per_cpu,
                },
            )
        ]


@hookimpl
def planaria_health_checks() -> Iterator[HealthCheckRecord]:
    yield HealthCheckRecord(
        name="loadavg",
        factory=LoadavgCheck,
        options=LoadavgOptions,
        summary="CPU load average per CPU, against degraded and failed thresholds",
    )
