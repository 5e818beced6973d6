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

from planaria.fault_pattern.api import (
    Classification,
    FaultClass,
    FaultPattern,
    Rule,
    first_match,
)
from planaria.fault_pattern.builtin import BUILTIN_PATTERNS
from planaria.moved import forward
from planaria.process import signal_name

_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):", re.MULTILINE)
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*)(?:Error|Exception|Fault|Interrupt|Exit)\b.*$")


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
        self._rules = [Rule.of(p, s) for p, s in rules]

    def match(self, log_tail: str) -> Classification | None:
        """The verdict of the first pattern found in ``log_tail``; None if none is."""
        return first_match(self._rules, log_tail)

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
            return Classification(FaultClass.TRANSIENT, f"killed by {signal_name(signal)}", "exit")
        if _TRACEBACK.search(log_tail) is not None:
            last = exception_line(log_tail)
            reason = f"Python exception: {last}" if last else "Python exception"
            return Classification(FaultClass.USER, reason, "exit", last)
        return Classification(FaultClass.TRANSIENT, f"exit code {exitcode}", "exit")


def exception_line(log_tail: str) -> str:
    """The ``SomeError: message`` line that ends the first traceback of ``log_tail`` and what
    it chains to (the last of them); "" when the log shows no traceback."""
    traceback = _TRACEBACK.search(log_tail)
    return "" if traceback is None else _last_exception(log_tail[traceback.start() :])


def _last_exception(text: str) -> str:
    """The ``SomeError: message`` line that ends a traceback (the last one, if chained)."""
    found = ""
    for line in text.splitlines():
        if _EXCEPTION_LINE.match(line.strip()) and not line.startswith(" "):
            found = line.strip()
    return found[:500]


_MOVED = {"planaria.fault_pattern.api": ("FaultKind", "match")}


def __getattr__(name: str) -> object:
    """What lived here before ``planaria.fault_pattern.api`` and is no longer used here
    (deprecated)."""
    return forward(__name__, _MOVED, name)
