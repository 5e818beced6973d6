"""The flash checkpoint on a CUDA device: pinned registration, bitwise saves and restores, the
overlapped save under its guard, and a DTensor's local shard (``pytest -m gpu``)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is false"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]

from planaria.checkpoint import Checkpointer  # noqa: E402
from planaria.checkpoint.device import CudaDevice  # noqa: E402
from planaria.checkpoint.segment import SLOTS  # noqa: E402


@pytest.fixture(autouse=True)
def standalone(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PLANARIA_CKPT_") or name in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)


def cuda_state(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "w": torch.randn(1 << 20, device="cuda", generator=gen),
        "h": torch.randn(333, 77, device="cuda", generator=gen).to(torch.bfloat16),
        "i": torch.randint(0, 1 << 40, (1001,), device="cuda", generator=gen),
        "cpu": torch.arange(10, dtype=torch.float64),
        "step": seed,
    }


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    )


class _Spy(CudaDevice):
    def __init__(self, holder: list[Checkpointer]) -> None:
        super().__init__(torch.cuda.current_device())
        self.holder = holder
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[tuple[int, bool]] = []

    def register(self, address: int, size: int) -> None:
        super().register(address, size)
        self.registered.append((address, size))

    def unregister(self, address: int) -> None:
        segment = self.holder[0]._segment
        self.unregistered.append((address, segment is not None and not segment._map.closed))
        super().unregister(address)


def test_the_segment_is_pinned_once_and_unpinned_before_unmap(tmp_path: Path) -> None:
    holder: list[Checkpointer] = []
    device = _Spy(holder)
    ckpt = Checkpointer(tmp_path / "ckpt", device=device)
    holder.append(ckpt)
    try:
        state = cuda_state()
        ckpt.prepare(state)
        for step in range(3):
            ckpt.save(step, state)
        segment = ckpt._segment
        assert segment is not None
        if segment._registering is not None:
            segment._registering.join()
        assert segment.registered("cuda")
        assert sorted(size for _, size in device.registered) == [segment.capacity] * SLOTS
        addresses = [address for address, _ in device.registered]
        valid = segment.valid()[0]
        assert segment.tensor(valid, 0, 64).is_pinned()  # CUDA sees the mapping as pinned
    finally:
        ckpt.close()
    assert sorted(device.unregistered) == sorted((address, True) for address in addresses)


def test_a_blocking_save_and_a_restore_of_cuda_tensors_are_bitwise_equal(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "ckpt")
    try:
        for step in range(3):  # the first save copies to pageable memory, the later to pinned
            state = cuda_state(step)
            ckpt.save(step, state)
            template = zeros_like(state)
            restored = ckpt.load(template)
            assert restored is not None and restored[0] == step
            for key in ("w", "h", "i", "cpu"):
                assert template[key].device == state[key].device
                assert bitwise_equal(template[key], state[key]), (step, key)
    finally:
        ckpt.close()


def test_a_restarted_checkpointer_restores_cuda_tensors_from_memory(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "ckpt")
    try:
        state = cuda_state(5)
        ckpt.save(5, state)
        ckpt._wrote = False  # as a restarted worker: nothing of the segment mapped here
        template = zeros_like(state)
        restored = ckpt.load(template)
        assert restored is not None and restored[0] == 5
        assert all(bitwise_equal(template[k], state[k]) for k in ("w", "h", "i", "cpu"))
    finally:
        ckpt.close()


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(1024, 1024)
        self.norm = torch.nn.BatchNorm1d(1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


def test_an_overlapped_save_under_the_guard_is_consistent(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Net().cuda()
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.guard(optim, model)
    try:
        for step in range(6):
            for _ in range(3):  # enough work that the copy and the next step overlap
                loss = model(torch.randn(512, 1024, device="cuda")).square().mean()
                optim.zero_grad()
                loss.backward()
                optim.step()
            state = {"model": model.state_dict(), "optim": optim.state_dict()}
            expected = {k: v.clone() for k, v in state["model"].items()}
            moment = optim.state_dict()["state"][0]["exp_avg"].clone()
            ckpt.save(step, state, blocking=False)
            loss = model(torch.randn(512, 1024, device="cuda")).square().mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            template = {"model": _Net().cuda().state_dict(), "optim": optim.state_dict()}
            restored = ckpt.load(template)
            assert restored is not None and restored[0] == step
            for key, value in expected.items():
                assert bitwise_equal(restored[1]["model"][key], value), (step, key)
            assert bitwise_equal(restored[1]["optim"]["state"][0]["exp_avg"], moment)
    finally:
        ckpt.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_dtensor_on_cuda_saves_and_restores_its_local_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        full = torch.randn(64, 32, device="cuda")
        dtensor = distribute_tensor(full, mesh, [Shard(0)])
        ckpt = Checkpointer(tmp_path / "ckpt")
        try:
            ckpt.save(3, {"p": dtensor})
            target = distribute_tensor(torch.zeros(64, 32, device="cuda"), mesh, [Shard(0)])
            restored = ckpt.load({"p": target})
            assert restored is not None and restored[0] == 3
            assert bitwise_equal(target.to_local(), dtensor.to_local())
        finally:
            ckpt.close()
    finally:
        dist.destroy_process_group()
