"""Flash checkpoints: training blocks only while its state is copied into shared memory.

    from planaria.checkpoint import Checkpointer

    ckpt = Checkpointer("checkpoints/")           # under planaria run: the job's storage
    restored = ckpt.load({"model": model.state_dict(), "optim": optim.state_dict()})
    for step in range(start, steps):
        train_step()
        ckpt.save(step, {"model": model.state_dict(), "optim": optim.state_dict()})
    ckpt.wait()                                    # the last persisted step is durable

Needs torch (``pip install planaria[torch]``). See :class:`Checkpointer`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from planaria.checkpoint.checkpointer import Checkpointer

__all__ = ["Checkpointer"]


def __getattr__(name: str) -> Any:
    # Lazily: the agent and the persister use this package's torch-free modules, and must not
    # pay for importing torch.
    if name == "Checkpointer":
        from planaria.checkpoint.checkpointer import Checkpointer

        return Checkpointer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
