"""What the XIDs this check cares about mean, after NVIDIA's Xid catalogue.

An XID is an error report of the NVIDIA driver. Most are raised by an application's own fault
(13 a graphics engine exception, 31 a memory page fault, 43 a stopped channel, 45 a channel torn
down because its process exited): a crashed training run leaves those behind on healthy hardware.
The default fatal list holds the ones that mean the GPU itself needs a reset or a repair.
"""

from __future__ import annotations

MEANINGS: dict[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup after a process ended",
    48: "double-bit (uncorrectable) ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "page retirement or row remapping recorded; reset the GPU to activate it",
    64: "page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained uncorrectable ECC error",
    95: "uncontained uncorrectable ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}

DEFAULT_FATAL: tuple[int, ...] = (48, 63, 64, 74, 79, 94, 95, 119, 120)
"""The GPU must be reset, drained or replaced: uncorrectable memory errors (48, 94, 95), memory
repairs pending or failed (63, 64), an NVLink fault (74), a GPU gone from the bus (79), and a GSP
firmware that stopped answering (119, 120)."""

DEFAULT_DEGRADED: tuple[int, ...] = (92,)
"""Corrected errors at a rate that predicts failure: the GPU still computes correctly."""


def describe(xid: int) -> str:
    meaning = MEANINGS.get(xid)
    return f"XID {xid} ({meaning})" if meaning else f"XID {xid}"
