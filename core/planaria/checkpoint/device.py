"""The device boundary of the flash checkpoint: where a save's copies run, and how they end.

A save copies each tensor into the shared-memory segment; a restore copies back. For a tensor
on an accelerator, the copy is a DMA between device memory and host memory, at the link's speed
only if the host memory is pinned: the segment is registered with the device runtime once
(:meth:`Device.register`, undone by :meth:`Device.unregister` before the mapping goes). The
copies are enqueued on a side stream of their own (:meth:`Device.copy`), after the work the
compute stream already has (:meth:`Device.start`: the tensors are what that work produces), and
end with one event (:meth:`Device.finish`): a :class:`Done` that the host can wait for, or that
the compute stream can be made to wait for (:meth:`Done.order`: training goes on queueing work,
and the device runs the next update of the state only after the copy).

- :class:`CpuDevice`: plain copies, done when :meth:`~Device.copy` returns; nothing to register.
- :class:`CudaDevice`: ``cudaHostRegister`` through torch's cudart binding, a side stream,
  non-blocking copies and an event.
- :class:`NpuDevice` (``torch_npu``): a side stream, non-blocking copies and an event; host
  memory is not registered yet (torch_npu has no binding of ``aclrtHostRegister``), so copies
  run from pageable memory.

:func:`device_for` picks one per ``torch.device``. ``planaria.testing.device.FakeDevice``
records every call and runs its copies only when they are waited for or ordered, so that the
ordering of an overlapped save is tested without a GPU.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class DeviceError(RuntimeError):
    """The device runtime refused something (the message names the call and its error)."""


class Done(ABC):
    """The end of one batch of copies."""

    @abstractmethod
    def query(self) -> bool:
        """Whether the copies are done (never blocks)."""

    @abstractmethod
    def wait(self) -> None:
        """Block the host until the copies are done."""

    def order(self) -> None:
        """Make work queued from now on on the compute stream run after the copies, without
        blocking the host. A device without streams waits."""
        self.wait()


class _Finished(Done):
    def query(self) -> bool:
        return True

    def wait(self) -> None:
        return None


FINISHED: Done = _Finished()
"""A batch whose copies were done when they were enqueued."""


class Device(ABC):
    """One device's copies to and from host memory."""

    kind: str = "cpu"
    registers: bool = False
    """Whether host memory must be registered for copies to run at the link's speed."""

    def register(self, address: int, size: int) -> None:  # noqa: B027 - optional
        """Register ``size`` bytes of host memory at ``address`` as pinned (page-locked)."""

    def unregister(self, address: int) -> None:  # noqa: B027 - optional
        """Undo :meth:`register` (before the memory is unmapped)."""

    def start(self) -> None:  # noqa: B027 - optional
        """Copies enqueued from now on run after the work already queued on the compute
        stream (which produced the tensors)."""

    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue ``dst.copy_(src)``; neither may change until :meth:`finish`'s batch is
        done."""

    def finish(self) -> Done:
        """The end of the copies enqueued since :meth:`start`."""
        return FINISHED


class CpuDevice(Device):
    """Tensors in host memory: a copy is a memcpy by the calling thread. Overlapping it with
    training would only make the two compete for the same memory bandwidth and cores."""

    kind = "cpu"

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)


class _EventDone(Done):
    def __init__(self, event: Any, current: Any) -> None:
        self.event = event
        self._current = current

    def query(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()

    def order(self) -> None:
        self._current().wait_event(self.event)


class _StreamDevice(Device):
    """A device with streams and events (``torch.cuda``, ``torch.npu``)."""

    def __init__(self, module: Any, index: int) -> None:
        self._module = module
        self.index = index
        with module.device(index):
            self.stream = module.Stream()

    def _current(self) -> Any:
        return self._module.current_stream(self.index)

    def start(self) -> None:
        self.stream.wait_stream(self._current())

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self._module.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        # The caching allocator must not hand a device tensor's memory to another tensor
        # before the side stream is done with it.
        for tensor in (dst, src):
            if tensor.device.type == self.kind:
                tensor.record_stream(self.stream)

    def finish(self) -> Done:
        event = self._module.Event()
        event.record(self.stream)
        return _EventDone(event, self._current)


CUDA_HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: the memory counts as pinned in every CUDA context."""


class CudaDevice(_StreamDevice):
    kind = "cuda"
    registers = True

    def __init__(self, index: int) -> None:
        import torch

        super().__init__(torch.cuda, index)

    def register(self, address: int, size: int) -> None:
        import torch

        cudart: Any = getattr(torch.cuda, "cudart")()  # noqa: B009 - untyped in torch
        error = cudart.cudaHostRegister(address, size, CUDA_HOST_REGISTER_PORTABLE)
        if int(error) != 0:
            raise DeviceError(f"cudaHostRegister of {size} bytes at {address:#x}: error {error}")

    def unregister(self, address: int) -> None:
        import torch

        cudart: Any = getattr(torch.cuda, "cudart")()  # noqa: B009 - untyped in torch
        error = cudart.cudaHostUnregister(address)
        if int(error) != 0:
            raise DeviceError(f"cudaHostUnregister at {address:#x}: error {error}")


class NpuDevice(_StreamDevice):
    """Ascend through ``torch_npu``: streams and events as CUDA's; host memory is not
    registered (no binding of ``aclrtHostRegister`` yet)."""

    kind = "npu"

    def __init__(self, index: int) -> None:
        import importlib

        import torch

        if not hasattr(torch, "npu"):
            importlib.import_module("torch_npu")  # adds torch.npu
        super().__init__(getattr(torch, "npu"), index)  # noqa: B009 - added by torch_npu


_devices: dict[tuple[str, int], Device] = {}
_devices_lock = threading.Lock()
CPU = CpuDevice()


def device_for(device: torch.device) -> Device:
    """The :class:`Device` of a ``torch.device`` (one per device: its side stream is reused)."""
    if device.type == "cpu":
        return CPU
    import torch

    if device.type not in ("cuda", "npu"):
        raise DeviceError(
            f"flash checkpoints copy tensors on cpu, cuda and npu devices, not {device.type}"
        )
    module = getattr(torch, device.type)
    index = device.index if device.index is not None else module.current_device()
    with _devices_lock:
        key = (device.type, index)
        if key not in _devices:
            _devices[key] = CudaDevice(index) if device.type == "cuda" else NpuDevice(index)
        return _devices[key]
