"""The ``nvidia`` section of a config file: what counts as a fault, and how bad it must be."""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ByteSize, ConfigDict, Field, model_validator

from planaria_nvidia.xids import DEFAULT_DEGRADED, DEFAULT_FATAL


class ThrottleReason(str, Enum):
    """Clock-event reasons that point at the hardware or its cooling, not at the workload."""

    HW_SLOWDOWN = "hw_slowdown"
    HW_THERMAL = "hw_thermal"
    HW_POWER_BRAKE = "hw_power_brake"
    SW_THERMAL = "sw_thermal"
    SW_POWER_CAP = "sw_power_cap"


class NvidiaOptions(BaseModel):
    """Thresholds of the ``nvidia`` check. Every counter NVML keeps since the driver loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    expected_devices: int | None = Field(
        default=None,
        ge=1,
        description="GPUs this node must have; unset: at least one",
    )
    max_uncorrectable_ecc: int = Field(
        default=0, ge=0, description="volatile uncorrectable ECC errors tolerated per GPU"
    )
    max_retired_pages: int = Field(
        default=60,
        ge=1,
        description="retired pages at which a GPU without row remapping fails (pre-Ampere)",
    )
    fatal_xids: list[int] = Field(
        default_factory=lambda: list(DEFAULT_FATAL),
        description="XIDs that fail the GPU when seen since the last check",
    )
    degraded_xids: list[int] = Field(
        default_factory=lambda: list(DEFAULT_DEGRADED),
        description="XIDs that mark the GPU degraded when seen since the last check",
    )
    throttle_reasons: list[ThrottleReason] = Field(
        default_factory=lambda: [
            ThrottleReason.HW_SLOWDOWN,
            ThrottleReason.HW_THERMAL,
            ThrottleReason.HW_POWER_BRAKE,
            ThrottleReason.SW_THERMAL,
        ],
        description="clock-event reasons that mark a GPU degraded",
    )
    max_temperature: int = Field(
        default=85, ge=1, description="GPU core temperature (C) above which a GPU is degraded"
    )
    max_nvlink_crc_errors: int = Field(
        default=100, ge=0, description="CRC errors (flit + data) tolerated per NVLink"
    )
    max_nvlink_replay_errors: int = Field(
        default=100, ge=0, description="replay errors tolerated per NVLink"
    )
    max_nvlink_recovery_errors: int = Field(
        default=10, ge=0, description="recovery errors tolerated per NVLink"
    )
    max_foreign_memory: ByteSize | None = Field(
        default=None,
        description="GPU memory other processes may already hold (e.g. 1GiB) before the GPU "
        "fails; unset: no limit",
    )
    flag_foreign_processes: bool = Field(
        default=True,
        description="a process other than this one and its children holding GPU memory (a "
        "killed worker's context) degrades the GPU; off where NVML names host pids (a container "
        "without the host's pid namespace)",
    )

    @model_validator(mode="after")
    def _xids_disjoint(self) -> NvidiaOptions:
        both = sorted(set(self.fatal_xids) & set(self.degraded_xids))
        if both:
            raise ValueError(
                f"XID {', '.join(map(str, both))} is listed in both fatal_xids and degraded_xids"
            )
        negative = sorted(x for x in (*self.fatal_xids, *self.degraded_xids) if x < 0)
        if negative:
            raise ValueError(f"XIDs are positive numbers, got {negative[0]}")
        return self
