"""What the master does with a diagnosis: the settings of its fault policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from planaria.diagnosis.classify import Classifier
from planaria.diagnosis.messages import BenchmarkSpec


@dataclass(frozen=True)
class PreflightPolicy:
    """``diagnosis.preflight*``, as the master runs the pre-flight node check."""

    enabled: bool = False
    benchmark: BenchmarkSpec | None = None
    factor: float = 2.0
    replace_stragglers: bool = False
    only: bool = False
    """``planaria check --preflight``: check the nodes, replace none, train nothing."""


@dataclass(frozen=True)
class DiagnosisPolicy:
    classifier: Classifier = field(default_factory=Classifier)
    straggler_factor: float = 2.0
    replace_stragglers: bool = False
    on_user_error: Literal["restart", "stop"] = "restart"
    crash_loop_rounds: int = 2
    preflight: PreflightPolicy = field(default_factory=PreflightPolicy)
