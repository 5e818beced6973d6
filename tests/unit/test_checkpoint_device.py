"""The device path of a save and a restore, on CPU with the fake device: what is registered and
when, what is waited for, and that an overlapped save stays consistent under its guard."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from planaria.checkpoint import Checkpointer  # noqa: E402
from planaria.checkpoint.segment import PAGE, SLOTS, WRITING, Segment  # noqa: E402
from planaria.testing.device import FakeDevice  # noqa: E402


@pytest.fixture(autouse=True)
def standalone(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PLANARIA_CKPT_") or name in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)


def steps_in_memory(ckpt: Checkpointer) -> list[int]:
    segment = Segment.open(ckpt.segment_path)
    try:
        return [i.step for i in segment.valid()]
    finally:
        segment.close()


def copies(device: FakeDevice) -> list[tuple[Any, ...]]:
    """The device's calls but its registrations, which run in the background beside them."""
    return [c for c in device.calls if c[0] not in ("register", "unregister")]


def writing(ckpt: Checkpointer) -> bool:
    segment = Segment.open(ckpt.segment_path)
    try:
        return any(i.state == WRITING for i in segment.infos())
    finally:
        segment.close()


def test_an_overlapped_save_is_complete_only_once_its_copies_are(tmp_path: Path) -> None:
    device = FakeDevice()
    ckpt = Checkpointer(tmp_path / "ckpt", device=device)
    try:
        ckpt.save(1, {"w": torch.full((64,), 1.0)})
        assert [c[0] for c in copies(device)[-4:]] == ["start", "copy", "finish", "wait"]
        state = {"w": torch.full((64,), 2.0), "b": torch.arange(8)}
        ckpt.save(2, state, blocking=False)
        assert copies(device)[-1] == ("finish", 2)  # enqueued, not waited for
        assert steps_in_memory(ckpt) == [1] and writing(ckpt)
        ckpt.wait_copy()
        assert copies(device)[-1] == ("wait",)
        assert steps_in_memory(ckpt) == [2, 1] and not writing(ckpt)
        restored = ckpt.load({"w": torch.zeros(64), "b": torch.zeros(8, dtype=torch.int64)})
        assert restored is not None and restored[0] == 2
        assert torch.equal(restored[1]["w"], state["w"]) and torch.equal(
            restored[1]["b"], state["b"]
        )
    finally:
        ckpt.close()


@pytest.mark.parametrize("call", ["save", "wait", "load", "close", "prepare"])
def test_save_wait_load_close_and_prepare_complete_a_pending_copy_first(
    tmp_path: Path, call: str
) -> None:
    device = FakeDevice()
    ckpt = Checkpointer(tmp_path / "ckpt", device=device)
    state = {"w": torch.full((64,), 1.0)}
    try:
        ckpt.save(1, state, persist=True, blocking=False)
        assert ckpt._persister.pending == collections_deque()  # not handed to the persister yet
        state["w"] += 1  # what a save of step 1 must not see: no guard here
        if call == "save":
            ckpt.save(2, {"w": torch.full((64,), 5.0)})
        elif call == "wait":
            ckpt.wait()
        elif call == "load":
            ckpt.load({"w": torch.zeros(64)})
        elif call == "prepare":
            ckpt.prepare(state)
        else:
            ckpt.close()
        assert ("wait",) in device.calls
        if call != "close":
            assert 1 in steps_in_memory(ckpt)
    finally:
        ckpt.close()
    if call in ("wait", "close"):  # step 1 went to storage after its copy, not before
        reader = Checkpointer(tmp_path / "ckpt")
        try:
            restored = reader.load({"w": torch.zeros(64)})
        finally:
            reader.close()
        assert restored is not None and restored[0] == 1


def collections_deque() -> Any:
    import collections

    return collections.deque(maxlen=3)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


def _train_on(ckpt: Checkpointer, guarded: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """One overlapped save, then one training step; (what the save saw, what it should have)."""
    torch.manual_seed(0)
    model = _Net()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    if guarded:
        ckpt.guard(optim, model)

    def step() -> None:
        loss = model(torch.randn(16, 8)).square().mean()
        optim.zero_grad()
        loss.backward()
        optim.step()

    step()
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    expected = {
        "model": {k: v.clone() for k, v in state["model"].items()},
        "exp_avg": optim.state_dict()["state"][0]["exp_avg"].clone(),
    }
    ckpt.save(1, state, blocking=False)
    step()  # its forward changes BatchNorm's statistics, its optimizer step the rest
    ckpt.wait_copy()
    template = {"model": _Net().state_dict(), "optim": optim.state_dict()}
    restored = ckpt.load(template)
    assert restored is not None and restored[0] == 1
    got = {
        "model": restored[1]["model"],
        "exp_avg": restored[1]["optim"]["state"][0]["exp_avg"],
    }
    return got, expected


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"]) and torch.equal(
        a["exp_avg"], b["exp_avg"]
    )


def test_the_guard_keeps_an_overlapped_save_consistent(tmp_path: Path) -> None:
    device = FakeDevice()
    ckpt = Checkpointer(tmp_path / "ckpt", device=device)
    try:
        got, expected = _train_on(ckpt, guarded=True)
        assert _same(got, expected)
        # The forward pre-hook came first (BatchNorm's running statistics), on the device:
        # the host did not wait.
        finish = next(i for i, c in enumerate(device.calls) if c[0] == "finish")
        assert device.calls[finish + 1] == ("order",)
    finally:
        ckpt.close()
    unguarded = Checkpointer(tmp_path / "other", device=FakeDevice())
    try:  # the control: without the guard the save sees the next step's values
        got, expected = _train_on(unguarded, guarded=False)
        assert not _same(got, expected)
    finally:
        unguarded.close()


class _Spy(FakeDevice):
    """Records whether the segment was still mapped when it was unregistered."""

    def __init__(self, ckpt: list[Checkpointer]) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.mapped_at_unregister: list[bool] = []

    def unregister(self, address: int) -> None:
        segment = self.ckpt[0]._segment
        assert segment is not None
        self.mapped_at_unregister.append(not segment._map.closed)
        super().unregister(address)


def test_the_segment_is_registered_once_off_the_save_and_unregistered_before_unmap(
    tmp_path: Path,
) -> None:
    holder: list[Checkpointer] = []
    device = _Spy(holder)
    ckpt = Checkpointer(tmp_path / "ckpt", device=device)
    holder.append(ckpt)
    try:
        for step in range(4):
            ckpt.save(step, {"w": torch.full((4096,), float(step))})
        segment = ckpt._segment
        assert segment is not None
        if segment._registering is not None:
            segment._registering.join()
        # Not during the first save (its copy would compete with it): after it, each slot
        # once, together the whole of the slots' memory.
        first_wait = device.calls.index(("wait",))
        register = [i for i, c in enumerate(device.calls) if c[0] == "register"]
        assert len(register) == SLOTS and min(register) > first_wait
        base = ctypes.addressof(ctypes.c_char.from_buffer(segment._map))
        assert device.registered == {
            base + PAGE + slot * segment.capacity: segment.capacity for slot in range(SLOTS)
        }
    finally:
        ckpt.close()
    assert device.count("unregister") == SLOTS and device.registered == {}
    assert device.mapped_at_unregister == [True] * SLOTS


def test_a_restarted_worker_registers_only_the_slot_it_restores_from(tmp_path: Path) -> None:
    """Registering is slower than the copy: a restore pins the one slot it reads, and the
    worker's first save the rest, in the background."""
    saver = Checkpointer(tmp_path / "ckpt", device=FakeDevice())
    try:
        state = {"w": torch.arange(4096, dtype=torch.float32)}
        for step in range(2):
            saver.save(step, state)
        holder: list[Checkpointer] = []
        device = _Spy(holder)
        restarted = Checkpointer(tmp_path / "ckpt", device=device)
        restarted.segment_path = saver.segment_path
        holder.append(restarted)
        try:
            template = {"w": torch.zeros(4096)}
            restored = restarted.load(template)
            assert restored is not None and restored[0] == 1
            assert torch.equal(template["w"], state["w"])
            segment = restarted._segment
            assert segment is not None
            newest = segment.valid()[0]
            base = ctypes.addressof(ctypes.c_char.from_buffer(segment._map))
            assert device.registered == {
                base + PAGE + newest.slot * segment.capacity: segment.capacity
            }
            restarted.save(2, state)
            if segment._registering is not None:
                segment._registering.join()
            assert len(device.registered) == SLOTS and segment.registered("fake")
        finally:
            restarted.close()
        assert device.count("unregister") == SLOTS and device.registered == {}
    finally:
        saver.close()


def test_a_restore_into_device_tensors_goes_through_the_device_once(tmp_path: Path) -> None:
    device = FakeDevice()
    ckpt = Checkpointer(tmp_path / "ckpt", device=device)
    try:
        state = {"a": torch.arange(100, dtype=torch.float32), "b": torch.ones(3, 3)}
        ckpt.save(7, state)
        del device.calls[:]
        template = {"a": torch.zeros(100), "b": torch.zeros(3, 3)}
        restored = ckpt.load(template)
        assert restored is not None and restored[0] == 7
        assert torch.equal(template["a"], state["a"]) and torch.equal(template["b"], state["b"])
        calls = [c[0] for c in device.calls]
        assert (
            calls.count("start") == 1
            and calls.count("copy") == 2
            and calls[-2:]
            == [
                "finish",
                "wait",
            ]
        )
    finally:
        ckpt.close()
