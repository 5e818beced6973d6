"""What every section of the job file is: a model that forbids unknown keys (a typo is an
error, never a setting silently ignored), and the backend section that chooses a plugin by
name and takes that plugin's options."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)

from planaria.errors import PluginError
from planaria.plugin.records import PluginKind


class Section(BaseModel):
    # Defaults are not re-validated: a default backend is resolved only if installed
    # (planaria.config.resolve), so that a file may leave out what its command never uses.
    model_config = ConfigDict(extra="forbid")


class BackendSection(Section):
    """``{backend: NAME, options: {...}}``: a plugin chosen by name, and its options.

    Validated with a plugin manager in the validation context (``context={"plugins": pm}``),
    ``backend`` must name an installed plugin of the section's kind and ``options`` becomes an
    instance of that plugin's ``Options`` model, so that every problem of the file, plugin
    options included, is reported in one pass. Without a manager ``options`` stays a mapping.
    """

    kind: ClassVar[PluginKind]

    backend: str = Field(min_length=1)
    options: Any = Field(default_factory=dict, description="the selected plugin's options")

    @field_validator("backend")
    @classmethod
    def _installed(cls, value: str, info: ValidationInfo) -> str:
        manager = (info.context or {}).get("plugins")
        if manager is not None:
            try:
                manager.resolve(cls.kind, value)
            except PluginError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("options")
    @classmethod
    def _validate_options(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, BaseModel):
            return value
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ValueError(f"expected a mapping of options, got {type(value).__name__}")
        manager = (info.context or {}).get("plugins")
        if manager is None or "backend" not in info.data:
            return value  # no manager, or the backend is already reported as unknown
        return manager.resolve(cls.kind, info.data["backend"]).options.model_validate(value)

    @property
    def resolved(self) -> bool:
        return isinstance(self.options, BaseModel)
