"""Records: what a plugin registers. One small frozen model per kind of plugin.

A record names an implementation class, the pydantic model that validates its config section
(``options``), and a one-line summary. Each kind's record sits in the kind's
``api`` module beside its interface (``planaria.health.api.HealthCheckRecord``); this module holds
what they share. Names are normalised (lower case, ``-`` becomes ``_``),
so ``custom-script`` and ``custom_script`` are the same name. Fault patterns are the one kind
whose records (:class:`~planaria.fault_pattern.api.FaultPattern`) have no name or factory: no
config selects them, every one installed classifies.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, field_validator

from planaria.moved import forward

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def normalize_name(name: str) -> str:
    """``"Custom-Script "`` -> ``"custom_script"``."""
    return name.strip().lower().replace("-", "_")


class PluginKind(str, Enum):
    HEALTH_CHECK = "health_check"
    SCHEDULER = "scheduler"
    CHECKPOINT_STORAGE = "checkpoint_storage"
    NODE_BENCHMARK = "node_benchmark"
    FAULT_PATTERN = "fault_pattern"
    """Unnamed and never selected: every registered pattern classifies, in order."""
    RENDEZVOUS = "rendezvous"
    """Rank placement in the master's rounds, selected by ``rendezvous.backend``."""

    @property
    def label(self) -> str:
        return self.value.replace("_", " ")

    @property
    def hook(self) -> str:
        # "rendezvous" is its own plural.
        return f"planaria_{self.value}" if self.value.endswith("s") else f"planaria_{self.value}s"


class NoOptions(BaseModel):
    """The options model of a plugin that takes none: any key is an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class PluginRecord(BaseModel):
    """Base of every record. Subclasses fix ``kind`` and the type of ``factory``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: ClassVar[PluginKind]
    well_known: ClassVar[dict[str, str]] = {}
    """Names of this kind whose provider is well known, and the distribution to install:
    an unknown-name error says what to ``pip install``. Only distributions this project
    publishes (its plugins/ folder): a package that does not exist sends the user nowhere."""

    name: str
    factory: type
    options: type[BaseModel] = NoOptions
    summary: str = ""

    @field_validator("name")
    @classmethod
    def _normalize(cls, value: str) -> str:
        name = normalize_name(value)
        if not _NAME.match(name):
            raise ValueError(
                f"plugin name {value!r} must start with a letter and hold only letters, "
                "digits, '_' and '-'"
            )
        return name

    @field_validator("options")
    @classmethod
    def _forbid_extra(cls, model: type[BaseModel]) -> type[BaseModel]:
        # A model that ignores unknown keys would let a user's typo pass silently.
        if model.model_config.get("extra") != "forbid":
            raise ValueError(
                f"options model {model.__name__} must set model_config = "
                "ConfigDict(extra='forbid') so that misspelled keys are reported"
            )
        return model

    @field_validator("summary")
    @classmethod
    def _one_line(cls, value: str) -> str:
        return " ".join(value.split())

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "name": self.name, "summary": self.summary}


_MOVED = {
    "planaria.health.api": ("HealthCheckRecord",),
    "planaria.scheduler.api": ("SchedulerRecord",),
    "planaria.storage.api": ("CheckpointStorageRecord",),
    "planaria.node_benchmark.api": ("NodeBenchmarkRecord",),
}


def __getattr__(name: str) -> object:
    """The kinds' records that lived here before their kind's ``api`` module (deprecated)."""
    return forward(__name__, _MOVED, name)
