"""Worker-side progress reporting: call :func:`step` once per training step.

It costs about a microsecond (a write into shared memory the agent reads, and a read of this
process's CPU clock), so call it every step. Outside ``planaria run`` it does nothing, except
fire chaos rules when ``PLANARIA_CHAOS`` is set, so a script runs the same under torchrun::

    from planaria import monitor
    for step in range(start, steps):
        train_step()
        monitor.step(step)

Each step also carries its busy time, which the agent uses to find stragglers: by default the
CPU time this process spent since the previous call. In data-parallel training every rank waits
for the slowest in each collective, so wall-clock step times are the same on every rank; the
time a rank spent working is not. Where the work is not on the CPU (GPU kernels), measure it
(e.g. with CUDA events around forward and backward) and pass it as ``busy``.
"""

from __future__ import annotations

import os
import time

from planaria.chaos import WorkerChaos
from planaria.progress import ENV, ProgressSlot

_slot: ProgressSlot | None = None
_chaos: WorkerChaos | None = None
_pid: int | None = None
_last_cpu: float | None = None
_burnt = 0.0


def _init() -> None:
    global _slot, _chaos, _pid, _last_cpu, _burnt
    _pid = os.getpid()  # a forked child must map its own slot
    path = os.environ.get(ENV)
    _slot = ProgressSlot(path, int(os.environ.get("LOCAL_RANK", "0"))) if path else None
    _chaos = WorkerChaos()
    _last_cpu, _burnt = None, 0.0


def step(number: int, busy: float | None = None) -> None:
    """Report that training step ``number`` has completed; ``busy``: the seconds this rank
    worked on it, if the process's CPU time does not say (work on an accelerator)."""
    global _last_cpu, _burnt
    if _pid != os.getpid():
        _init()
    cpu = time.process_time()
    if busy is None and _last_cpu is not None:
        busy = cpu - _last_cpu
    if _slot is not None:
        _slot.write(number, time.time(), busy)
    _last_cpu = cpu
    if _chaos is not None and _chaos.rules:
        # A slow_worker rule burns CPU in proportion to the step's own work, not to its burn.
        _burnt = _chaos.check(number, None if busy is None else max(0.0, busy - _burnt))
