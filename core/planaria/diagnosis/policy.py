"""What the master does with a diagnosis: the settings of its fault policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from planaria.diagnosis.classify import Classifier


@dataclass(frozen=True)
class DiagnosisPolicy:
    classifier: Classifier = field(default_factory=Classifier)
    straggler_factor: float = 2.0
    replace_stragglers: bool = False
    on_user_error: Literal["restart", "stop"] = "restart"
