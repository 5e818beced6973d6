"""What the NVIDIA driver's, CUDA's and NCCL's messages in a failed worker's log mean.

planaria tries these after the job's own ``diagnosis.fault_patterns`` and before its built-in,
vendor-neutral ones; the first that matches decides. Their order matters where one log holds
several messages:

1. The fatal Xids (:data:`~planaria_nvidia.xids.DEFAULT_FATAL`): the driver's own verdict that
   the GPU needs a reset or a repair. ``node``: replace the node, exclude its host.
2. Other hardware wording (a GPU fallen off the bus, uncorrectable ECC or NVLink errors, no
   usable GPU): ``node``.
3. The Xids NVIDIA's catalogue puts on the application: 13 (graphics engine exception), 31 (GPU
   memory page fault) and 43 (GPU stopped processing) are ``user``, like a Python exception: the
   program faulted on healthy hardware, so the job restarts in place (or stops, with
   ``diagnosis.on_user_error: stop``) and no host is excluded. 45 (preemptive cleanup) is
   ``transient``: the driver tearing down the channels of a process that ended for another
   reason (a kill, a peer's fault) names no cause of its own. They come before the CUDA errors
   below because they say more: an illegal memory access with an Xid 31 beside it is the
   program's out-of-bounds access, not a failing GPU.
4. CUDA errors that usually mean failing hardware (an illegal memory access, an unspecified
   launch failure): ``node``.
5. Any other Xid, out of memory, NCCL errors: ``transient``, a restart in place cures them.

The Xid patterns follow the driver's kernel-log format,
``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus.``, and also read
``Xid 79`` and ``Xid: 79``. They use the default fatal list, not an ``nvidia`` check's
``fatal_xids`` (patterns take no config); a job reclassifies an Xid with its own
``diagnosis.fault_patterns``, which come first.
"""

from __future__ import annotations

from planaria.plugin import FaultKind, FaultPattern
from planaria_nvidia.xids import DEFAULT_FATAL, describe

APPLICATION_XIDS: dict[int, FaultKind] = {13: "user", 31: "user", 43: "user", 45: "transient"}
"""Xids raised by an application's own fault on healthy hardware, and their class."""


def _xid(numbers: str) -> str:
    """A regex for an Xid report whose number matches ``numbers`` (itself a regex)."""
    return rf"\bXid\b(?: \([^)\n]*\))?:? ?(?:{numbers})\b"


def _p(pattern: str, kind: FaultKind, reason: str) -> FaultPattern:
    return FaultPattern(pattern=pattern, kind=kind, reason=reason)


def _fatal() -> list[FaultPattern]:
    return [
        _p(_xid(str(xid)), "node", f"NVIDIA {describe(xid)}: the GPU needs a reset or a repair")
        for xid in DEFAULT_FATAL
    ]


def _application() -> list[FaultPattern]:
    why = {"user": "most often the program's own fault", "transient": "no cause of its own"}
    return [
        _p(_xid(str(xid)), kind, f"NVIDIA {describe(xid)}: {why[kind]}")
        for xid, kind in APPLICATION_XIDS.items()
    ]


PATTERNS: tuple[FaultPattern, ...] = (
    *_fatal(),
    _p(r"(?i)fallen off the bus", "node", "GPU fell off the bus"),
    _p(r"CUDA error: uncorrectable ECC error encountered", "node",
       "CUDA uncorrectable ECC error (GPU memory)"),
    _p(r"CUDA error: (?:an illegal instruction was encountered|uncorrectable NVLink error)",
       "node", "CUDA hardware error"),
    _p(r"CUDA-capable device\(s\) is/are busy or unavailable|no CUDA-capable device is detected",
       "node", "GPU unavailable"),
    _p(r"(?i)NVLink.*(?:error|fatal)", "node", "NVLink error"),
    *_application(),
    _p(r"CUDA error: an illegal memory access was encountered", "node",
       "CUDA illegal memory access (often a failing GPU)"),
    _p(r"CUDA error: unspecified launch failure", "node", "CUDA unspecified launch failure"),
    _p(_xid(r"\d+"), "transient",
       "NVIDIA Xid error, neither a hardware nor an application fault (see the line)"),
    _p(r"CUDA out of memory", "transient", "CUDA out of memory"),
    _p(r"ncclSystemError|ncclInternalError|ncclRemoteError|ncclUnhandledCudaError"
       r"|NCCL error|NCCL WARN", "transient", "NCCL error"),
)  # fmt: skip
"""In the order they are tried (see the module's docstring)."""
