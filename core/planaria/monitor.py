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

A step may carry its training loss, ``monitor.step(step, loss=loss.item())``: the agent's
heartbeat takes rank 0's last one to the master, which puts it in the job's timeline, so that
``planaria report`` draws the loss curve and ``/metrics`` serves ``planaria_loss``. Report it
from a number the script has anyway (the value it prints): ``loss.item()`` on a GPU waits for
the device, so pass it on the steps the script logs, not on every step if it does not log
every step. A loss that is not a real number (a tensor, a string) is a ``TypeError`` at the
call. A loss that is NaN or infinite is left out of the series, with a ``RuntimeWarning`` the
first time: a diverged step is the training's to handle (skip it, lower the learning rate), not
a reason for the monitor to fail the run, and a curve cannot draw it.

A step may also carry the tokens it processed, ``monitor.step(step, tokens=n)``: the number the
whole job processed in this step, all data-parallel ranks together (e.g. batch size x sequence
length x data-parallel size), so that the job's throughput reads in tokens per second. Like the
loss it is rank 0's that counts (another rank's is ignored; passing it everywhere is harmless);
unlike the loss it is summed: pass it on every step (or the sum since the last call that had
it), it costs the same slot write as the step. The worker sums them, the heartbeat carries the
sum, and the master counts them into ``planaria_tokens_total`` and the timeline, so that
``planaria report`` draws tokens/s rather than steps/s and the summary states the mean tokens/s
over the training time. Steps done again after a restore count again: it measures the work done,
not how far through the data the training got. Tokens must be an ``int`` or a real number, not
negative and finite: anything else is a ``TypeError`` (not a number) or a ``ValueError`` at the
call, naming the step (the number is computed, not measured: a wrong one is a bug to see).
"""

from __future__ import annotations

import math
import numbers
import os
import time
import warnings

from planaria.chaos import WorkerChaos
from planaria.progress import ENV, ProgressSlot

_slot: ProgressSlot | None = None
_chaos: WorkerChaos | None = None
_pid: int | None = None
_last_cpu: float | None = None
_burnt = 0.0
_warned = False


def _init() -> None:
    global _slot, _chaos, _pid, _last_cpu, _burnt
    _pid = os.getpid()  # a forked child must map its own slot
    path = os.environ.get(ENV)
    _slot = ProgressSlot(path, int(os.environ.get("LOCAL_RANK", "0"))) if path else None
    _chaos = WorkerChaos()
    _last_cpu, _burnt = None, 0.0


def step(
    number: int,
    busy: float | None = None,
    loss: float | None = None,
    tokens: float | None = None,
) -> None:
    """Report that training step ``number`` has completed; ``busy``: the seconds this rank
    worked on it, if the process's CPU time does not say (work on an accelerator); ``loss``:
    its training loss, a Python number; ``tokens``: the tokens the whole job processed in it
    (see the module's documentation)."""
    global _last_cpu, _burnt
    if _pid != os.getpid():
        _init()
    if loss is not None:
        loss = loss_value(loss, number)
    if tokens is not None:
        tokens = tokens_value(tokens, number)
    cpu = time.process_time()
    if busy is None and _last_cpu is not None:
        busy = cpu - _last_cpu
    if _slot is not None:
        _slot.write(number, time.time(), busy, loss, tokens)
    _last_cpu = cpu
    if _chaos is not None and _chaos.rules:
        # A slow_worker rule burns CPU in proportion to the step's own work, not to its burn.
        _burnt = _chaos.check(number, None if busy is None else max(0.0, busy - _burnt))


def loss_value(loss: object, number: int) -> float | None:
    """``loss`` as :func:`step` takes it: a float, or None for a NaN or infinite one (warned of
    once a process). Raises ``TypeError`` for anything but a real number, naming the step."""
    global _warned
    if type(loss) is not float:
        if isinstance(loss, bool) or not isinstance(loss, numbers.Real):
            hint = " (pass loss.item())" if hasattr(loss, "item") else ""
            raise TypeError(
                f"planaria.monitor.step({number}, loss=...): the loss must be a number, "
                f"not {type(loss).__name__}{hint}"
            )
        loss = float(loss)
    if math.isfinite(loss):
        return loss
    if not _warned:
        _warned = True
        warnings.warn(
            f"planaria.monitor.step({number}, loss={loss}): a loss that is not finite is left "
            "out of the job's loss series (this one and any later one; told once)",
            RuntimeWarning,
            stacklevel=3,
        )
    return None


def tokens_value(tokens: object, number: int) -> float:
    """``tokens`` as :func:`step` takes them: a float. Raises ``TypeError`` for anything but a
    real number and ``ValueError`` for a negative or not finite one, naming the step."""
    if (
        type(tokens) is not int
        and type(tokens) is not float
        and (isinstance(tokens, bool) or not isinstance(tokens, numbers.Real))
    ):
        hint = " (pass int(...) or .item())" if hasattr(tokens, "item") else ""
        raise TypeError(
            f"planaria.monitor.step({number}, tokens=...): the tokens must be a number, "
            f"not {type(tokens).__name__}{hint}"
        )
    try:
        value = float(tokens)
    except OverflowError:  # an int past a float's range
        value = math.inf
    if not (0.0 <= value < math.inf):  # NaN fails both comparisons
        raise ValueError(
            f"planaria.monitor.step({number}, tokens={tokens!r}): the tokens must be a finite "
            "number not below 0 (the tokens the whole job processed in this step)"
        )
    return value
