"""The ``ascend`` section of a config file."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from planaria.durations import Duration


class AscendOptions(BaseModel):
    """Where npu-smi is, how long its queries may take, and what counts as a fault."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    expected_devices: int | None = Field(
        default=None,
        ge=1,
        description="NPU chips (torch devices) this node must have; unset: at least one",
    )
    npu_smi: str = Field(
        default="npu-smi", description="the npu-smi executable: a name looked up on PATH, or a path"
    )
    command_timeout: Duration = Field(default=10.0, description="limit of each npu-smi query")
    torch_npu: bool = Field(
        default=True, description="when torch_npu is installed, check that it loads and counts"
    )
    torch_npu_timeout: Duration = Field(
        default=60.0, description="limit of the torch_npu probe (it imports torch)"
    )
    max_temperature: int = Field(
        default=85, ge=1, description="chip temperature (C) above which an NPU is degraded"
    )
    max_hbm_double_bit_errors: int = Field(
        default=0, ge=0, description="uncorrectable (double-bit) memory errors tolerated per chip"
    )

    @field_validator("npu_smi")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("npu_smi must name an executable")
        return value
