"""Flash checkpoints: the memory path, the persister's commit protocol, verified restore."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from planaria.checkpoint import Checkpointer  # noqa: E402
from planaria.checkpoint.layout import LayoutError, plan, rebuild  # noqa: E402
from planaria.checkpoint.segment import Segment  # noqa: E402
from planaria.errors import StorageError  # noqa: E402
from planaria.master.restore import agree  # noqa: E402
from planaria.protocol import MemoryHolding, RendezvousInfo  # noqa: E402
from support.checkpoints import equal_trees, store_at  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def standalone(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PLANARIA_CKPT_") or name in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)


def model_state(seed: int = 0) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 32)).sum().backward()
    optim.step()
    return model, optim


# -- layout -----------------------------------------------------------------------------------


def test_layout_round_trips_every_supported_value() -> None:
    state = {
        "f32": torch.randn(3, 4),
        "strided": torch.randn(4, 6).t(),  # not contiguous
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "ints": {0: torch.arange(3), 1: "x", (2, "a"): None},
        "tuple": (1, 2.5, "three", [4, {"five": 5}]),
        "tagged": {"T": 7},  # looks like an internal tag: must survive as data
        "big": 1 << 70,
        "bytes": b"\x00\xff",
        "dtype": torch.float16,
        "flag": False,
    }
    layout = plan(state)
    buffers = [t.contiguous().clone() for t in layout.tensors]
    back = rebuild(json.loads(json.dumps(layout.tree)), lambda i, _old: buffers[i])
    assert equal_trees(state, back)
    assert all(e.offset % 64 == 0 for e in layout.entries)


def test_layout_names_the_path_of_what_it_cannot_hold() -> None:
    with pytest.raises(LayoutError, match=r"optim\.hook: a value of type function"):
        plan({"optim": {"hook": lambda: None}})
    with pytest.raises(LayoutError, match="sparse"):
        plan({"w": torch.eye(3).to_sparse()})


# -- memory -----------------------------------------------------------------------------------


def test_save_and_load_from_memory_fills_the_template_in_place(tmp_path: Path) -> None:
    model, optim = model_state()
    ckpt = Checkpointer(tmp_path / "ckpt")
    try:
        ckpt.save(7, {"model": model.state_dict(), "optim": optim.state_dict(), "epoch": 1})
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        template = {"model": model.state_dict()}
        restored = ckpt.load(template)
        assert restored is not None
        step, state = restored
        assert step == 7 and ckpt.restored_from == "memory" and state["epoch"] == 1
        for key, value in model.state_dict().items():  # the model itself is restored
            assert torch.equal(value, expected[key]), key
        assert state["model"]["0.weight"] is template["model"]["0.weight"]
        fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fresh.load_state_dict(state["optim"])
        assert equal_trees(fresh.state_dict(), optim.state_dict())
        assert ckpt.segment_path.parent.parent == Path("/dev/shm")
        assert ckpt.segment_path.stat().st_mode & 0o777 == 0o600
        assert ckpt.segment_path.parent.stat().st_mode & 0o777 == 0o700
    finally:
        ckpt.close()
    assert not ckpt.segment_path.exists() and not ckpt.segment_path.parent.exists()


def test_a_save_killed_midway_leaves_the_previous_step_whole(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "ckpt")
    segment_path = ckpt.segment_path
    try:
        state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
        ckpt.save(1, state)
        # Another process starts the next save and dies inside it, holding the slot's lock.
        code = textwrap.dedent(
            f"""
            import os
            from pathlib import Path
            from planaria.checkpoint.segment import Segment
            seg = Segment.open(Path({str(segment_path)!r}), writable=True)
            with seg.writing() as (slot, view):
                view[:1000].fill_(7)
                os._exit(3)
            """
        )
        result = subprocess.run([sys.executable, "-c", code], timeout=60)
        assert result.returncode == 3
        seg = Segment.open(segment_path)
        try:
            assert [i.step for i in seg.valid()] == [1]
            assert any(i.state == 1 for i in seg.infos())  # the torn slot says WRITING
        finally:
            seg.close()
        state["w"].zero_()
        restored = ckpt.load(state)
        assert restored is not None and restored[0] == 1
        assert torch.equal(state["w"], torch.arange(1 << 16, dtype=torch.float32))
    finally:
        ckpt.close()
        segment_path.unlink(missing_ok=True)


def test_a_pinned_step_survives_later_saves_and_saves_do_not_wait(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "ckpt")
    try:
        ckpt.save(1, {"w": torch.full((1024,), 1.0)})
        # Another process pins step 1, as the persister does while it writes it.
        code = textwrap.dedent(
            f"""
            import sys
            from pathlib import Path
            from planaria.checkpoint.segment import Segment
            seg = Segment.open(Path({str(ckpt.segment_path)!r}))
            info = seg.pin(1)
            print("pinned", flush=True)
            sys.stdin.readline()
            print(bytes(seg.data(info)[:4]).hex(), sorted(i.step for i in seg.valid()), flush=True)
            """
        )
        reader = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert reader.stdout is not None and reader.stdin is not None
            assert reader.stdout.readline().strip() == "pinned"
            # The pin is held until after the saves: a save that waited for it would never
            # return (no timing bound: the checkpoint benchmark measures the speed).
            saves = threading.Thread(
                target=lambda: [
                    ckpt.save(step, {"w": torch.full((1024,), float(step))}) for step in range(2, 6)
                ],
                daemon=True,
            )
            saves.start()
            saves.join(60)
            assert not saves.is_alive(), "a save waited for the step another process pinned"
            reader.stdin.write("\n")
            reader.stdin.flush()
            # 1.0 as float32 is 0000803f: step 1 is intact; the newest step is 5, and the
            # step before it too (a save never writes over the newest step).
            assert reader.stdout.readline().strip() == "0000803f [1, 4, 5]"
        finally:
            reader.kill()
            reader.wait()
    finally:
        ckpt.close()


# -- persisting and the commit protocol ------------------------------------------------------


def test_persist_commits_with_a_manifest_and_keeps_the_last_k(tmp_path: Path) -> None:
    model, _optim = model_state()
    ckpt = Checkpointer(tmp_path / "ckpt", keep_last=2)
    try:
        for step in range(6):
            ckpt.save(step, {"model": model.state_dict()}, persist=step % 2 == 1)
        ckpt.wait()
    finally:
        ckpt.close()
    root = tmp_path / "ckpt"
    assert sorted(os.listdir(root)) == ["latest", "step-3", "step-5"]
    assert json.loads((root / "latest").read_text()) == {"step": 5}
    manifest = json.loads((root / "step-5" / "manifest.json").read_text())
    assert manifest["world"] == 1 and manifest["hash"] == "xxh3_64"
    shard = root / "step-5" / "rank-0.bin"
    assert manifest["files"]["rank-0.bin"]["size"] == shard.stat().st_size
    assert shard.stat().st_mode & 0o777 == 0o600

    fresh = Checkpointer(tmp_path / "ckpt")  # a new process: memory is gone, storage is not
    try:
        other, _ = model_state(seed=1)
        restored = fresh.load({"model": other.state_dict()})
        assert restored is not None and restored[0] == 5 and fresh.restored_from == "storage"
        assert equal_trees(other.state_dict(), model.state_dict())
    finally:
        fresh.close()


def test_a_flipped_byte_is_rejected_with_a_warning_and_the_previous_step_loads(
    tmp_path: Path,
) -> None:
    ckpt = Checkpointer(tmp_path / "ckpt")
    try:
        ckpt.save(10, {"w": torch.full((4096,), 10.0)}, persist=True)
        ckpt.save(20, {"w": torch.full((4096,), 20.0)}, persist=True)
        ckpt.wait()
    finally:
        ckpt.close()
    shard = tmp_path / "ckpt" / "step-20" / "rank-0.bin"
    raw = bytearray(shard.read_bytes())
    raw[1234] ^= 0x01
    shard.write_bytes(bytes(raw))
    loader = Checkpointer(tmp_path / "ckpt")
    try:
        with pytest.warns(UserWarning, match=r"skipping checkpoint step-20: .*checksum"):
            restored = loader.load()
        assert restored is not None
        step, state = restored
        assert step == 10 and torch.equal(state["w"], torch.full((4096,), 10.0))
    finally:
        loader.close()


def test_a_truncated_shard_or_missing_manifest_is_never_loaded(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "ckpt", keep_last=5)
    try:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((64,), float(step))}, persist=True)
        ckpt.wait()
    finally:
        ckpt.close()
    root = tmp_path / "ckpt"
    (root / "step-3" / "manifest.json").unlink()
    with open(root / "step-2" / "rank-0.bin", "r+b") as f:
        f.truncate(100)
    loader = Checkpointer(root)
    try:
        with pytest.warns(UserWarning) as caught:
            restored = loader.load()
        messages = " | ".join(str(w.message) for w in caught)
        assert "step-3/manifest.json: missing" in messages
        assert "step-2/rank-0.bin: 100 bytes, the manifest says" in messages
        assert restored is not None and restored[0] == 1
    finally:
        loader.close()


@pytest.mark.slow
def test_killing_the_persister_mid_write_never_exposes_the_partial_step(tmp_path: Path) -> None:
    """The persister is stopped (SIGSTOP) as soon as a step's ``.partial`` directory shows, and
    killed while it still shows. On a busy machine a write can outrun the look (this thread
    waits its turn for the CPU): then that step committed whole, and the next step is tried
    with twice the state (96 MiB, then up to 384 MiB), whose write takes twice as long."""
    root = tmp_path / "ckpt"
    ckpt = Checkpointer(root, keep_last=3)

    def state(step: int, n: int) -> dict[str, torch.Tensor]:
        return {"w": torch.full((n,), float(step))}

    committed = [1]
    try:
        ckpt.save(1, state(1, 16), persist=True)
        ckpt.wait()
        for step in range(2, 8):
            mib = 96 << min(step - 2, 2)
            ckpt.save(step, state(step, mib << 18), persist=True)  # float32: MiB << 18 of them
            persister = ckpt._persister.process
            assert persister is not None
            partial, whole = root / f"step-{step}.partial", root / f"step-{step}"
            deadline = time.monotonic() + 30
            while not partial.exists() and not whole.exists() and time.monotonic() < deadline:
                time.sleep(0.001)
            persister.send_signal(signal.SIGSTOP)
            if partial.exists() and not whole.exists():  # caught mid-write: frozen there
                persister.kill()
                persister.wait()
                assert not whole.exists() and partial.exists()
                break
            persister.send_signal(signal.SIGCONT)  # the write outran the look: the next step
            ckpt.wait()
            committed.append(step)
        else:
            pytest.skip(
                "no write of up to 384 MiB lasted long enough to be seen on this busy "
                "machine (6 tries): the test could not catch the persister mid-write"
            )
    finally:
        ckpt.close()
    loader = Checkpointer(root)
    try:
        restored = loader.load()
        assert restored is not None and restored[0] == committed[-1]
        assert torch.equal(restored[1]["w"], torch.full_like(restored[1]["w"], committed[-1]))
    finally:
        loader.close()
    assert sorted(store_at(root).committed_steps()) == committed[-3:]


def test_disk_full_is_a_clear_error_and_nothing_committed_is_lost(small_disk: Path) -> None:
    ckpt = Checkpointer(small_disk / "ckpt", keep_last=3)
    try:
        ckpt.save(1, {"w": torch.full((1 << 18,), 1.0)}, persist=True)  # 1 MiB
        ckpt.wait()
        for step in range(2, 6):  # 3 MiB each: the disk fills up
            ckpt.save(step, {"w": torch.full((3 << 18,), float(step))}, persist=True)
        with pytest.raises(StorageError, match="No space left on device"):
            ckpt.wait()
        # Training goes on: saving to memory still works.
        ckpt.save(6, {"w": torch.full((3 << 18,), 6.0)})
    finally:
        ckpt.close()
    loader = Checkpointer(small_disk / "ckpt")
    try:
        restored = loader.load()
        assert restored is not None and restored[0] == 1
        assert torch.equal(restored[1]["w"], torch.full((1 << 18,), 1.0))
    finally:
        loader.close()


# -- agreement between ranks -----------------------------------------------------------------


def info(node_rank: int, procs: int, nodes: int) -> RendezvousInfo:
    return RendezvousInfo(
        round=2,
        node_rank=node_rank,
        num_nodes=nodes,
        rank_offset=node_rank * procs,
        world_size=nodes * procs,
        master_addr="127.0.0.1",
        master_port=1,
    )


def holding(local_rank: int, rank: int, world: int, *steps: int) -> MemoryHolding:
    return MemoryHolding(local_rank=local_rank, rank=rank, world=world, steps=list(steps))


def test_the_master_restores_from_memory_only_when_every_rank_holds_the_step() -> None:
    world = {"a": info(0, 2, 2), "b": info(1, 2, 2)}
    memory = {
        "a": [holding(0, 0, 4, 30, 29), holding(1, 1, 4, 30, 29)],
        "b": [holding(0, 2, 4, 30, 29), holding(1, 3, 4, 29, 28)],  # rank 3 died mid-save
    }
    assert agree(world, memory, 2) == (29, "every rank holds step 29 in memory")
    memory["b"][1] = holding(1, 3, 4, 28, 27)  # two ranks at different steps
    step, why = agree(world, memory, 2)
    assert step is None and "no common step" in why
    del memory["b"]  # a replaced node
    step, why = agree(world, memory, 2)
    assert step is None and "rank 2 (b) holds no step" in why
    swapped = {"a": info(1, 2, 2), "b": info(0, 2, 2)}
    memory = {"a": [holding(0, 0, 4, 5), holding(1, 1, 4, 5)]}
    assert agree(swapped, memory, 2)[0] is None


# How a rank of the scripts below ends. destroy_process_group() leaves a gloo process group
# alive while anything still refers to it (a DTensor's or an FSDP module's mesh does), and with
# it gloo's worker threads. A normal interpreter exit then races them: a worker thread that
# drops the last reference to a tensor needs the GIL, and a finalizing interpreter ends such a
# thread with pthread_exit, whose unwinding through a C++ noexcept destructor is std::terminate
# ("terminate called without an active exception", SIGABRT). So once the checkpointer is
# closed and the output flushed, a rank leaves without finalizing the interpreter.
END = """
ckpt.close()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""

WORKER = (
    textwrap.dedent(
        """
        import json, os, sys
        import torch, torch.distributed as dist
        from planaria.checkpoint import Checkpointer
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        ckpt = Checkpointer(sys.argv[1])
        steps = json.loads(sys.argv[2])[str(rank)]
        for step in steps:
            ckpt.save(step, {"w": torch.full((8,), float(step * 10 + rank))}, persist=step == 3)
        ckpt.wait()
        restored = ckpt.load()
        print(json.dumps({"rank": rank, "step": restored[0], "from": ckpt.restored_from,
                          "w": restored[1]["w"][0].item()}), flush=True)
        """
    )
    + END
)


def run_ranks(tmp_path: Path, script: str, world: int, *args: str) -> list[dict[str, Any]]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "worker.py"
    path.write_text(script)
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(path), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.send_signal(signal.SIGKILL)
            raise
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.slow
def test_ranks_at_different_steps_in_memory_restore_from_storage(tmp_path: Path) -> None:
    steps = {0: [1, 2, 3, 4, 5], 1: [1, 2, 3, 4]}  # rank 1 is a step behind
    results = run_ranks(tmp_path, WORKER, 2, str(tmp_path / "ckpt"), json.dumps(steps))
    assert [(r["step"], r["from"]) for r in results] == [(3, "storage"), (3, "storage")]
    assert [r["w"] for r in results] == [30.0, 31.0]
    same = {0: [1, 2, 3, 4], 1: [1, 2, 3, 4]}
    results = run_ranks(tmp_path, WORKER, 2, str(tmp_path / "ckpt2"), json.dumps(same))
    assert [(r["step"], r["from"]) for r in results] == [(4, "memory"), (4, "memory")]


DTENSOR = (
    textwrap.dedent(
        """
    import json, os, sys
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from planaria.checkpoint import Checkpointer
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)
    ckpt = Checkpointer(sys.argv[1])
    if sys.argv[2] == "save":
        w = distribute_tensor(full, mesh, [Shard(0)])
        ckpt.save(5, {"w": w, "step": 5}, persist=True)
        ckpt.wait()
        out = {"rank": rank, "local": list(w.to_local().shape)}
    else:
        w = distribute_tensor(torch.zeros(10, 6), mesh, [Shard(0)])
        step, state = ckpt.load({"w": w})
        out = {"rank": rank, "step": step, "from": ckpt.restored_from,
               "ok": torch.equal(state["w"].full_tensor(), full),
               "local": list(state["w"].to_local().shape)}
    print(json.dumps(out), flush=True)
    """
    )
    + END
)


@pytest.mark.slow
def test_sharded_dtensor_state_reshards_on_load(tmp_path: Path) -> None:
    saved = run_ranks(tmp_path, DTENSOR, 2, str(tmp_path / "ckpt"), "save")
    assert [r["local"] for r in saved] == [[5, 6], [5, 6]]
    loaded = run_ranks(tmp_path, DTENSOR, 3, str(tmp_path / "ckpt"), "load")
    assert all(r["ok"] and r["step"] == 5 and r["from"] == "storage" for r in loaded), loaded
    assert [r["local"] for r in loaded] == [[4, 6], [4, 6], [2, 6]]


FSDP2 = (
    textwrap.dedent(
        """
    import json, os, sys
    import torch, torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from planaria.checkpoint import Checkpointer
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 30), torch.nn.Linear(30, 4))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(sys.argv[1])

    def full(sd):
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sd.items()}

    def exp_avg(osd):
        return full({k: v["exp_avg"] for k, v in osd["state"].items()})

    if sys.argv[2] == "save":
        model(torch.randn(4, 16)).sum().backward()
        optim.step()
        msd, osd = get_state_dict(model, optim)
        ckpt.save(1, {"model": msd, "optim": osd}, persist=True)
        ckpt.wait()
        ref = {"model": full(msd), "exp_avg": exp_avg(osd)}  # collectives: every rank
        if rank == 0:
            torch.save(ref, sys.argv[1] + ".ref")
        out = {"rank": rank}
    else:
        msd, osd = get_state_dict(model, optim)  # the template: this world's sharding
        step, state = ckpt.load({"model": msd, "optim": osd})
        set_state_dict(
            model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        msd, osd = get_state_dict(model, optim)
        ref = torch.load(sys.argv[1] + ".ref", weights_only=True)
        out = {
            "rank": rank,
            "step": step,
            "model": all(torch.equal(v, ref["model"][k]) for k, v in full(msd).items()),
            "optim": all(torch.equal(v, ref["exp_avg"][k]) for k, v in exp_avg(osd).items()),
        }
    print(json.dumps(out), flush=True)
    """
    )
    + END
)


@pytest.mark.slow
def test_fsdp2_model_and_optimizer_saved_by_two_ranks_load_into_three(tmp_path: Path) -> None:
    run_ranks(tmp_path, FSDP2, 2, str(tmp_path / "ckpt"), "save")
    loaded = run_ranks(tmp_path, FSDP2, 3, str(tmp_path / "ckpt"), "load")
    assert loaded == [{"rank": r, "step": 1, "model": True, "optim": True} for r in range(3)]


def test_a_killed_standalone_trainer_leaves_nothing_in_shared_memory(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import torch
        from planaria.checkpoint import Checkpointer
        ckpt = Checkpointer({str(tmp_path / "ckpt")!r})
        ckpt.save(1, {{"w": torch.ones(1 << 16)}}, persist=True)
        ckpt.wait()
        ckpt.save(2, {{"w": torch.ones(1 << 16)}}, persist=True)  # in flight when killed
        print(ckpt.segment_path, flush=True)
        import time; time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    segment = Path(proc.stdout.readline().strip())
    assert segment.exists()
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10  # the persister notices, finishes step 2, cleans up
    while segment.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not segment.exists()
    assert store_at(tmp_path / "ckpt").committed_steps() == [2, 1]
