"""Worker-side progress reporting: call :func:`step` once per training step.

It costs a few hundred nanoseconds (a write into shared memory the agent reads), so call it
every step. Outside ``planaria run`` it does nothing, except fire chaos rules when
``PLANARIA_CHAOS`` is set, so a script runs the same under torchrun::

    from planaria import monitor
    for step in range(start, steps):
        train_step()
        monitor.step(step)
"""

from __future__ import annotations

import os
import time

from planaria.chaos import WorkerChaos
from planaria.progress import ENV, ProgressSlot

_slot: ProgressSlot | None = None
_chaos: WorkerChaos | None = None
_pid: int | None = None


def _init() -> None:
    global _slot, _chaos, _pid
    _pid = os.getpid()  # a forked child must map its own slot
    path = os.environ.get(ENV)
    _slot = ProgressSlot(path, int(os.environ.get("LOCAL_RANK", "0"))) if path else None
    _chaos = WorkerChaos()


def step(number: int) -> None:
    """Report that training step ``number`` has completed."""
    if _pid != os.getpid():
        _init()
    if _slot is not None:
        _slot.write(number, time.time())
    if _chaos is not None and _chaos.rules:
        _chaos.check(number)
