"""The fault-pattern kind: what a line in a failed worker's log says about where the fault lies.

A :class:`FaultPattern` is the record: a regular expression and the class of fault a match
means. Plugins register them through ``planaria_fault_patterns``; a job adds its own under
``diagnosis.fault_patterns``. Unlike the other kinds they have no name and no factory: no config
selects them, every one installed classifies (see :mod:`planaria.diagnosis.classify`).
:func:`match` tests patterns on a recorded log line the way the classifier would.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class FaultClass(str, Enum):
    NODE = "node"
    TRANSIENT = "transient"
    USER = "user"


FaultKind = Literal["node", "transient", "user"]


class FaultPattern(BaseModel):
    """A regular expression over a failed worker's log tail, and what a match means::

    FaultPattern(pattern=r"NVRM: Xid .*: 79\\b", kind="node", reason="GPU fell off the bus")

    The expression is searched line by line (``re.MULTILINE``), case-sensitively unless it says
    ``(?i)``. ``reason`` is what the timeline and the summary show; it defaults to the pattern.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    pattern: str = Field(min_length=1, description="a Python regular expression")
    kind: FaultKind
    reason: str = Field(default="", description="shown in the timeline; default: the pattern")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value, re.MULTILINE)
        except re.error as exc:
            raise ValueError(f"invalid regular expression {value!r}: {exc}") from None
        return value

    @property
    def label(self) -> str:
        return self.reason or self.pattern


@dataclass(frozen=True)
class Classification:
    """The verdict on one failed worker: its class, why, and the log line that said so."""

    kind: FaultClass
    reason: str
    source: str
    """``config``, ``plugin <name>``, ``builtin``, ``exit`` (the exit status alone),
    ``start`` (the workers never started) or ``pattern`` (from :func:`match`)."""
    line: str = ""

    def describe(self) -> str:
        return f"{self.kind.value} fault: {self.reason}"


@dataclass(frozen=True)
class Rule:
    """A compiled pattern and where it came from (``config``, ``plugin NAME``, ``builtin``)."""

    regex: re.Pattern[str]
    pattern: FaultPattern
    source: str

    @classmethod
    def of(cls, pattern: FaultPattern, source: str) -> Rule:
        return cls(re.compile(pattern.pattern, re.MULTILINE), pattern, source)


def first_match(rules: Iterable[Rule], log_tail: str) -> Classification | None:
    """The verdict of the first of ``rules`` found in ``log_tail``, or None."""
    for rule in rules:
        found = rule.regex.search(log_tail)
        if found is not None:
            return Classification(
                FaultClass(rule.pattern.kind),
                rule.pattern.label,
                rule.source,
                _line_at(log_tail, found.start()),
            )
    return None


def match(patterns: FaultPattern | Iterable[FaultPattern], text: str) -> Classification | None:
    """The verdict of the first of ``patterns`` found in ``text`` (a log line or tail), as the
    classifier would give it, or None: how a plugin tests its patterns on recorded messages::

        verdict = match(planaria_fault_patterns(), "NVRM: Xid (PCI:0000:3b:00): 79, ...")
        assert verdict is not None and verdict.kind is FaultClass.NODE
    """
    if isinstance(patterns, FaultPattern):
        patterns = [patterns]
    return first_match([Rule.of(p, "pattern") for p in patterns], text)


def _line_at(text: str, index: int) -> str:
    start = text.rfind("\n", 0, index) + 1
    end = text.find("\n", index)
    return text[start : end if end >= 0 else len(text)].strip()[:500]
