"""The core's own fault patterns: vendor-neutral ones (a driver's and a collective library's
messages come with the vendor's plugin, which knows what each of them means)."""

from __future__ import annotations

from planaria.fault_pattern.api import FaultKind, FaultPattern


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
