"""A fake accelerator for the flash checkpoint's device boundary
(:mod:`planaria.checkpoint.device`).

:class:`FakeDevice` records every call and, like a real side stream, does not run a copy when
it is enqueued: its batch runs when the host waits for it (:meth:`~FakeDone.wait`) or orders
the compute stream after it (:meth:`~FakeDone.order`), or when a test says so (:meth:`run`). A
tensor changed before then is copied changed, as on a GPU: so a test shows that a save, a guard
or a load waits where it must, on CPU tensors.

    device = FakeDevice()
    ckpt = Checkpointer(tmp_path, device=device)
    ckpt.save(1, state, blocking=False)
    assert device.calls[-1][0] == "finish"
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from planaria.checkpoint.device import Device, Done

if TYPE_CHECKING:
    import torch


class FakeDone(Done):
    def __init__(self, device: FakeDevice, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.device = device
        self.copies = copies
        self.ran = False

    def _run(self) -> None:
        if not self.ran:
            self.ran = True
            for dst, src in self.copies:
                dst.copy_(src)

    def query(self) -> bool:
        return self.ran

    def wait(self) -> None:
        self.device.calls.append(("wait",))
        self._run()

    def order(self) -> None:
        self.device.calls.append(("order",))
        self._run()


class FakeDevice(Device):
    """Records ``(call, *arguments)`` in :attr:`calls`; copies run late (see the module)."""

    kind = "fake"
    registers = True

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.registered: dict[int, int] = {}
        """address -> size of the host memory registered now."""
        self._batch: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.pending: list[FakeDone] = []

    def register(self, address: int, size: int) -> None:
        self.calls.append(("register", address, size))
        self.registered[address] = size

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", address))
        del self.registered[address]

    def start(self) -> None:
        self.calls.append(("start",))
        self._batch = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.calls.append(("copy", tuple(src.shape)))
        self._batch.append((dst, src))

    def finish(self) -> Done:
        self.calls.append(("finish", len(self._batch)))
        done = FakeDone(self, self._batch)
        self._batch = []
        self.pending.append(done)
        return done

    def run(self) -> None:
        """Run every copy enqueued so far (the device caught up)."""
        for done in self.pending:
            done._run()

    def count(self, call: str) -> int:
        return sum(1 for c in self.calls if c[0] == call)
