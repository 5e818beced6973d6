"""The ``custom_script`` section of a config file.

The script is checked when the config is loaded, so a typo in its path or a missing ``chmod +x``
is a config error naming ``...options.path`` instead of a failed node at rendezvous time.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from planaria.durations import Duration


class CustomScriptOptions(BaseModel):
    """Which executable to run, with what arguments and environment, and for how long."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Path = Field(
        description="the executable; a relative path resolves against the current directory"
    )
    args: list[str] = Field(default_factory=list, description="arguments, passed as they are")
    timeout: Duration = Field(default=30.0, description="e.g. 30s, 5m, 500ms or seconds")
    env: dict[str, str] = Field(
        default_factory=dict, description="variables added to the inherited environment"
    )
    kill_grace: Duration = Field(
        default=1.0, description="time between SIGTERM and SIGKILL when the script is stopped"
    )

    @field_validator("path")
    @classmethod
    def _executable_file(cls, value: Path) -> Path:
        path = value.expanduser()
        if not path.is_absolute():
            path = Path.cwd() / path
        if not path.exists():
            raise ValueError(f"custom script {path} does not exist")
        if not path.is_file():
            raise ValueError(f"custom script {path} is not a regular file")
        if not os.access(path, os.X_OK):
            raise ValueError(f"custom script {path} is not executable (try: chmod +x {path})")
        return path

    @field_validator("env")
    @classmethod
    def _valid_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name, setting in value.items():
            if not name or "=" in name or "\0" in name:
                raise ValueError(f"environment variable name {name!r} is not valid")
            if "\0" in setting:
                raise ValueError(f"environment variable {name} holds a NUL character")
        return value
