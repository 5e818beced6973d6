"""Fault classification: what a worker's exit says about where the fault lies.

A failed worker is classified from its exit code, its signal and the tail of its log, against
patterns: the job's own (``diagnosis.fault_patterns``) first, then those plugins register
(``planaria_fault_patterns``), then the built-in ones below; the first match wins. The built-in
ones know no vendor: a driver's and a collective library's messages (CUDA, NVIDIA Xids, NCCL,
HCCL) come with the vendor's plugin, which knows what each of them means. The class decides the
master's action:

- ``node``: bad hardware (an uncorrectable ECC error, a GPU that fell off the bus, a fatal Xid):
  the node is replaced and its host excluded; restarting in place would fail again.
- ``transient``: a lost peer, a collective that timed out, a kill: restart in place.
- ``user``: a Python exception with no hardware pattern, most likely the training script's
  own bug: restarted in place by default (``diagnosis.on_user_error``), and charged to the budget
  like every restart.
"""

from __future__ import annotations

import re
import signal as _signal
from collections.abc import Iterable, Sequence
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


def _p(pattern: str, kind: FaultKind, reason: str) -> FaultPattern:
    return FaultPattern(pattern=pattern, kind=kind, reason=reason)


# Hardware first: a device error shows up inside a Python traceback, and must not read as the
# user's bug (a vendor plugin's patterns come earlier still, for the same reason). Then what
# running out of memory, a lost peer or a flaky fabric looks like, which a restart cures.
BUILTIN_PATTERNS: tuple[FaultPattern, ...] = (
    _p(r"(?i)uncorrectable ECC error", "node", "uncorrectable ECC error"),
    _p(r"\bOutOfMemoryError\b", "transient", "out of memory (torch.OutOfMemoryError)"),
    _p(r"^MemoryError\b", "transient", "out of host memory (MemoryError)"),
    _p(r"Watchdog caught collective operation timeout", "transient", "collective timed out"),
    _p(r"(?i)gloo.*(?:Connection closed by peer|Connection reset by peer|Broken pipe|Timed out)"
       r"|Connection closed by peer|Connection reset by peer", "transient",
       "a peer was lost (its collective connection closed)"),
)  # fmt: skip

_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):", re.MULTILINE)
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*)(?:Error|Exception|Fault|Interrupt|Exit)\b.*$")


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
class _Rule:
    regex: re.Pattern[str]
    pattern: FaultPattern
    source: str

    @classmethod
    def of(cls, pattern: FaultPattern, source: str) -> _Rule:
        return cls(re.compile(pattern.pattern, re.MULTILINE), pattern, source)


def _first_match(rules: Iterable[_Rule], log_tail: str) -> Classification | None:
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
    return _first_match([_Rule.of(p, "pattern") for p in patterns], text)


class Classifier:
    """Classifies worker exits against ordered pattern lists (first match wins)."""

    def __init__(
        self,
        config: Sequence[FaultPattern] = (),
        plugins: Iterable[tuple[str, FaultPattern]] = (),
        builtin: Sequence[FaultPattern] = BUILTIN_PATTERNS,
    ) -> None:
        rules = [(p, "config") for p in config]
        rules += [(p, f"plugin {name}") for name, p in plugins]
        rules += [(p, "builtin") for p in builtin]
        self._rules = [_Rule.of(p, s) for p, s in rules]

    def match(self, log_tail: str) -> Classification | None:
        """The verdict of the first pattern found in ``log_tail``; None if none is."""
        return _first_match(self._rules, log_tail)

    def classify(self, exitcode: int | None, signal: int | None, log_tail: str) -> Classification:
        matched = self.match(log_tail)
        if matched is not None:
            return matched
        if signal == _signal.SIGKILL or exitcode == 128 + _signal.SIGKILL:
            return Classification(
                FaultClass.TRANSIENT,
                "killed by SIGKILL (the kernel's OOM killer, an operator or a fault injection)",
                "exit",
            )
        if signal is not None:
            return Classification(FaultClass.TRANSIENT, f"killed by {_signame(signal)}", "exit")
        traceback = _TRACEBACK.search(log_tail)
        if traceback is not None:
            last = _last_exception(log_tail[traceback.start() :])
            reason = f"Python exception: {last}" if last else "Python exception"
            return Classification(FaultClass.USER, reason, "exit", last)
        return Classification(FaultClass.TRANSIENT, f"exit code {exitcode}", "exit")


def _line_at(text: str, index: int) -> str:
    start = text.rfind("\n", 0, index) + 1
    end = text.find("\n", index)
    return text[start : end if end >= 0 else len(text)].strip()[:500]


def _last_exception(text: str) -> str:
    """The ``SomeError: message`` line that ends a traceback (the last one, if chained)."""
    found = ""
    for line in text.splitlines():
        if _EXCEPTION_LINE.match(line.strip()) and not line.startswith(" "):
            found = line.strip()
    return found[:500]


def _signame(number: int) -> str:
    try:
        return _signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
