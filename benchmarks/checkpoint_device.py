"""Flash checkpoint of device tensors: ``benchmarks/checkpoint.py --device cuda``.

One state dict of float32 tensors on the device (default 4 GiB: a model plus two Adam moments,
the shapes of ``harness.make_state``) is saved and restored by each method below, every one
of them in each of ``--runs`` runs; the table shows the median, min and max.

Save (the time training is blocked; each ends when the copy is complete):

- ``pageable D2H floor``: ``tensor.to("cpu")`` of every tensor (new pageable memory).
- ``pinned D2H floor``: a copy of every tensor into one buffer of
  ``torch.empty(..., pin_memory=True)`` allocated once, ``non_blocking=True``, then one
  synchronize. Nothing saves device memory to host memory faster.
- ``planaria save, blocking``: :meth:`Checkpointer.save` (``persist=False``), once its segment
  exists.
- ``planaria save, overlapped``: ``save(..., blocking=False)``: until it returns (the copy goes
  on in the background); then the benchmark waits and checks, outside the timing, that what it
  saved restores bitwise. Where this Checkpointer has no ``blocking`` argument (or no
  ``guard``), the report says "overlapped save: not available".
- ``torch.save + fsync`` and ``dcp.async_save`` (until it returns: its blocking part), as in
  the CPU benchmark.

Restore (into existing device tensors; each ends when the copy is complete):

- ``pageable H2D floor``: ``copy_`` from the pageable copies the D2H floor made.
- ``pinned H2D floor``: ``copy_(..., non_blocking=True)`` from the pinned buffer, one
  synchronize.
- ``planaria load, same process``: :meth:`Checkpointer.load` by the Checkpointer that saved.
- ``planaria load, restarted worker``: a new process (CUDA initialised, target tensors
  allocated before the timing) restores from memory, then compares every tensor bitwise with
  the state regenerated from the seed. The restore ratio uses this one.

Step cost: ``--steps`` training steps of ``--step-matmuls`` bf16 matmuls plus an SGD step over
the model's tensors, without saves, with a blocking save every step, and with an overlapped
save every step (its guard on the optimizer waits for the pending copy before the SGD step
writes the tensors): the cost of a save is the difference in step time.

The targets (PASS/FAIL lines): blocking save <= 1.15x the pinned D2H floor; overlapped save
blocks <= 0.1x that floor; restore <= 1.3x the pinned H2D floor; every restore bitwise equal.

``--cpu-dry-run`` runs this code path on CPU tensors (no pinned memory, no CUDA events): it
checks the script where there is no GPU; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if not __package__:  # loaded by its path, not as benchmarks.NAME: import through the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import fstype, leaves, make_state

TARGETS = {
    "save_vs_pinned_d2h": 1.15,
    "overlapped_blocked_vs_pinned_d2h": 0.10,
    "restore_vs_pinned_h2d": 1.3,
}
SAVE_ROWS = [
    ("floor_pageable_d2h", "pageable D2H floor (tensor.to('cpu'))"),
    ("floor_pinned_d2h", "pinned D2H floor (non_blocking + sync)"),
    ("save", "planaria save, blocking"),
    ("save_overlapped", "planaria save, overlapped (until it returns)"),
    ("torch_save", "torch.save + flush + fsync"),
    ("dcp_async", "dcp.async_save (until it returns)"),
]
RESTORE_ROWS = [
    ("floor_pageable_h2d", "pageable H2D floor"),
    ("floor_pinned_h2d", "pinned H2D floor (non_blocking + sync)"),
    ("restore_same", "planaria load, same process"),
    ("restore", "planaria load, restarted worker"),
]
STEP_ROWS = [
    ("step_none", "step, no save"),
    ("step_blocking", "step + blocking save"),
    ("step_overlapped", "step + overlapped save"),
]


class Device:
    """The device the state lives on, and how to wait for it."""

    def __init__(self, name: str, dry_run: bool) -> None:
        self.dry_run = dry_run
        if dry_run:
            self.device = torch.device("cpu")
            return
        self.device = torch.device(name)
        if self.device.type != "cuda":
            raise SystemExit(f"--device {name}: only cuda devices are supported here")
        if not torch.cuda.is_available():
            raise SystemExit(
                f"--device {name}: torch cannot use CUDA here (torch {torch.__version__}, "
                f"CUDA build {torch.version.cuda}, torch.cuda.is_available() is False); "
                "run on a GPU machine, or pass --cpu-dry-run to check the script on CPU"
            )
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.index >= torch.cuda.device_count():
            raise SystemExit(
                f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
        torch.cuda.set_device(self.device)

    @property
    def name(self) -> str:
        return "cpu (dry run)" if self.dry_run else str(self.device)

    def describe(self) -> str:
        if self.dry_run:
            return "CPU dry run of the device path: the figures mean nothing"
        return f"{torch.cuda.get_device_name(self.device)}, CUDA {torch.version.cuda}"

    def sync(self) -> None:
        if not self.dry_run:
            torch.cuda.synchronize(self.device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=not self.dry_run)


def overlapped_support(ckpt: Any) -> str | None:
    """None when this Checkpointer can save without blocking and guard an optimizer, else why
    not."""
    if "blocking" not in inspect.signature(type(ckpt).save).parameters:
        return "Checkpointer.save has no blocking argument"
    if not hasattr(ckpt, "guard"):
        return "Checkpointer has no guard(optimizer)"
    return None


def views_of(buffer: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    views, offset = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        views.append(buffer[offset : offset + n].view(t.dtype).view(t.shape))
        offset = (offset + n + 63) // 64 * 64
    return views


def buffer_bytes(tensors: list[torch.Tensor]) -> int:
    return sum((t.numel() * t.element_size() + 63) // 64 * 64 for t in tensors)


def bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class DeviceBench:
    def __init__(
        self, args: argparse.Namespace, dev: Device, work: Path, stack: contextlib.ExitStack
    ) -> None:
        from planaria.checkpoint import Checkpointer

        self.args, self.dev, self.work, self.stack = args, dev, work, stack
        self.Checkpointer = Checkpointer
        self.times: dict[str, list[float]] = {
            key: [] for key, _ in SAVE_ROWS + RESTORE_ROWS + STEP_ROWS
        }
        device = str(dev.device)
        self.state = make_state(args.size_mib, args.tensors, args.seed, fill=True, device=device)
        self.tensors = leaves(self.state)
        self.target = make_state(args.size_mib, args.tensors, args.seed, fill=False, device=device)
        self.target_tensors = leaves(self.target)
        self.bytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.pinned = dev.host_buffer(buffer_bytes(self.tensors))
        self.pinned_views = views_of(self.pinned, self.tensors)
        self.pageable: list[torch.Tensor] = []
        self.storage = work / "storage"
        self.spec = {"backend": "local", "options": {"path": str(self.storage)}}
        self.ckpt = Checkpointer(self.spec)
        stack.callback(self.ckpt.close)
        self.overlap_missing = overlapped_support(self.ckpt)
        self.step = 0
        self.bitwise: list[bool] = []

    def next_step(self) -> int:
        self.step += 1
        return self.step

    def timed(self, action: Callable[[], Any]) -> float:
        """Wall seconds of ``action`` until the device finished what it enqueued."""
        self.dev.sync()
        started = time.perf_counter()
        action()
        self.dev.sync()
        return time.perf_counter() - started

    def record(self, key: str, seconds: float) -> None:
        self.times[key].append(seconds)

    # -- floors ----------------------------------------------------------------------------------

    def pageable_d2h(self) -> None:
        self.pageable = [t.to("cpu") for t in self.tensors]

    def pinned_d2h(self) -> None:
        for dst, src in zip(self.pinned_views, self.tensors, strict=True):
            dst.copy_(src, non_blocking=True)

    def pageable_h2d(self) -> None:
        for dst, src in zip(self.target_tensors, self.pageable, strict=True):
            dst.copy_(src)

    def pinned_h2d(self) -> None:
        for dst, src in zip(self.target_tensors, self.pinned_views, strict=True):
            dst.copy_(src, non_blocking=True)

    # -- the runs --------------------------------------------------------------------------------

    def warm_up(self) -> None:
        self.ckpt.save(self.next_step(), self.state, persist=False)  # creates the segment
        self.ckpt.save(self.next_step(), self.state, persist=False)
        self.pageable_d2h()
        self.pinned_d2h()
        self.dev.sync()
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            store=dist.FileStore(str(self.work / "pg-store"), 1),  # type: ignore[attr-defined]
            rank=0,
            world_size=1,
        )
        self.stack.callback(dist.destroy_process_group)
        self.dcp_async(self.work / "dcp-warm-up")

    def run(self, run: int) -> None:
        pairs = [
            ("floor_pinned_d2h", self.pinned_d2h),
            ("save", lambda: self.ckpt.save(self.next_step(), self.state, persist=False)),
        ]
        for key, action in pairs if run % 2 == 0 else reversed(pairs):
            self.record(key, self.timed(action))
        self.record("floor_pageable_d2h", self.timed(self.pageable_d2h))
        self.restore_checks("after the blocking save")

        if self.overlap_missing is None:
            step = self.next_step()
            started = time.perf_counter()
            self.ckpt.save(step, self.state, persist=False, blocking=False)
            self.record("save_overlapped", time.perf_counter() - started)
            self.finish_overlapped()
            self.restore_checks("after the overlapped save", timed=False)

        self.record("floor_pinned_h2d", self.timed(self.pinned_h2d))
        self.record("floor_pageable_h2d", self.timed(self.pageable_h2d))

        path = self.work / "torch.pt"
        self.record("torch_save", self.timed(lambda: self.torch_save(path)))
        path.unlink()
        self.record("dcp_async", self.dcp_async(self.work / f"dcp-{run}"))

        self.record("restore", self.restore_in_child())
        self.step_costs()

    def finish_overlapped(self) -> None:
        """Wait for an overlapped save's copies (and its completion), outside any timing."""
        wait_copy = getattr(self.ckpt, "wait_copy", None)
        if callable(wait_copy):
            wait_copy()
        self.ckpt.wait()
        self.dev.sync()

    def restore_checks(self, when: str, timed: bool = True) -> None:
        """Restore into the zeroed target and compare it bitwise with the state."""
        for t in self.target_tensors:
            t.zero_()
        result: list[Any] = []
        seconds = self.timed(lambda: result.append(self.ckpt.load(self.target)))
        loaded = result[0]
        if loaded is None or loaded[0] != self.step or self.ckpt.restored_from != "memory":
            raise RuntimeError(
                f"{when}: restored {loaded and loaded[0]} from {self.ckpt.restored_from}, "
                f"expected step {self.step} from memory"
            )
        same = bitwise_equal(self.target_tensors, self.tensors)
        self.bitwise.append(same)
        if not same:
            raise RuntimeError(f"{when}: the restored tensors differ from the saved ones")
        if timed:
            self.record("restore_same", seconds)

    def torch_save(self, path: Path) -> None:
        with open(path, "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())

    def dcp_async(self, path: Path) -> float:
        import torch.distributed.checkpoint as dcp

        self.dev.sync()
        started = time.perf_counter()
        future = dcp.async_save(self.state, checkpoint_id=str(path))  # type: ignore[attr-defined]
        seconds = time.perf_counter() - started
        getattr(future, "upload_completion", future).result()
        shutil.rmtree(path)
        return seconds

    def restore_in_child(self) -> float:
        env = {
            **os.environ,
            "PLANARIA_CKPT_SEGMENT": str(self.ckpt.segment_path),
            "PLANARIA_CKPT_SOCKET": str(self.work / "no-persister.sock"),
            "PLANARIA_CKPT_STORAGE": json.dumps(self.spec),
            "PLANARIA_CKPT_RESTORE": f"memory:{self.step}",
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("RANK", None)
        env.pop("WORLD_SIZE", None)
        command = [
            sys.executable,
            str(Path(__file__).resolve().parent / "checkpoint.py"),
            "--restore-child",
            "--device", self.args.device,
            "--size-mib", str(self.args.size_mib),
            "--tensors", str(self.args.tensors),
            "--seed", str(self.args.seed),
        ] + (["--cpu-dry-run"] if self.dev.dry_run else [])  # fmt: skip
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"the restarted worker failed: {proc.stderr.strip()[-2000:]}")
        report = json.loads(lines[-1])
        if report["source"] != "memory" or report["step"] != self.step:
            raise RuntimeError(f"the restarted worker restored {report}")
        self.bitwise.append(bool(report["bitwise"]))
        if not report["bitwise"]:
            raise RuntimeError("the restarted worker restored other bits than were saved")
        return float(report["seconds"])

    # -- step cost -------------------------------------------------------------------------------

    def step_costs(self) -> None:
        size = 256 if self.dev.dry_run else self.args.step_size
        a = torch.randn(size, size, device=self.dev.device, dtype=torch.bfloat16)
        b = torch.randn(size, size, device=self.dev.device, dtype=torch.bfloat16)
        c = torch.empty(size, size, device=self.dev.device, dtype=torch.bfloat16)
        params = list(self.state["model"].values())
        for p in params:
            p.grad = torch.zeros_like(p)  # SGD adds -lr * 0: the values stay, the writes happen
        optimizer = torch.optim.SGD(params, lr=1e-3)
        steps = self.args.steps

        def loop(mode: str) -> float:
            self.dev.sync()
            started = time.perf_counter()
            for _ in range(steps):
                for _ in range(self.args.step_matmuls):
                    torch.mm(a, b, out=c)
                optimizer.step()
                if mode == "blocking":
                    self.ckpt.save(self.next_step(), self.state, persist=False)
                elif mode == "overlapped":
                    self.ckpt.save(self.next_step(), self.state, persist=False, blocking=False)
            if mode == "overlapped":
                self.finish_overlapped()
            self.dev.sync()
            return (time.perf_counter() - started) / steps

        try:
            self.record("step_none", loop("none"))
            self.record("step_blocking", loop("blocking"))
            if self.overlap_missing is None:
                handles = self.ckpt.guard(optimizer)
                try:
                    self.record("step_overlapped", loop("overlapped"))
                finally:
                    for handle in handles if isinstance(handles, (list, tuple)) else [handles]:
                        remove = getattr(handle, "remove", None)
                        if callable(remove):
                            remove()
        finally:
            for p in params:
                p.grad = None
        self.restore_checks("after the training steps", timed=False)


def restore_child(args: argparse.Namespace) -> None:
    """A restarted worker on the device: time one load from memory, compare bitwise."""
    from planaria.checkpoint import Checkpointer

    dev = Device(args.device, args.cpu_dry_run)
    device = str(dev.device)
    target = make_state(args.size_mib, args.tensors, args.seed, fill=False, device=device)
    dev.sync()
    ckpt = Checkpointer()
    try:
        started = time.perf_counter()
        result = ckpt.load(target)
        dev.sync()
        seconds = time.perf_counter() - started
        source = ckpt.restored_from
    finally:
        ckpt.close()
    expected = make_state(args.size_mib, args.tensors, args.seed, fill=True, device=device)
    print(
        json.dumps(
            {
                "seconds": seconds,
                "source": source,
                "step": result[0] if result is not None else None,
                "bitwise": bitwise_equal(leaves(target), leaves(expected)),
            }
        ),
        flush=True,
    )


def table(bench: DeviceBench) -> dict[str, float]:
    medians = {k: statistics.median(v) for k, v in bench.times.items() if v}
    gib = bench.bytes / (1 << 30)
    for title, rows in (
        ("save (training blocked)", SAVE_ROWS),
        ("restore", RESTORE_ROWS),
        (f"step time ({bench.args.steps} steps)", STEP_ROWS),
    ):
        print(f"\n{title:<46} {'median':>9} {'min':>9} {'max':>9} {'GB/s':>7}")
        for key, label in rows:
            values = bench.times[key]
            if not values:
                print(f"  {label:<44} not available: {bench.overlap_missing}")
                continue
            rate = f"{bench.bytes / 1e9 / medians[key]:>7.2f}" if not key.startswith("step") else ""
            print(
                f"  {label:<44} {medians[key]:>8.4f}s {min(values):>8.4f}s "
                f"{max(values):>8.4f}s {rate}"
            )
    print(f"\n({bench.bytes / 1e9:.2f} GB = {gib:.2f} GiB of state)")
    return medians


def run_device(args: argparse.Namespace, parent: Path) -> dict[str, Any]:
    dev = Device(args.device, args.cpu_dry_run)
    if args.size_mib is None:
        args.size_mib = 64.0 if dev.dry_run else 4096.0
    with contextlib.ExitStack() as stack:
        work = Path(tempfile.mkdtemp(prefix="planaria-bench-ckpt-", dir=parent))
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        bench = DeviceBench(args, dev, work, stack)
        print(
            f"flash checkpoint on {dev.name} ({dev.describe()}): {bench.bytes / (1 << 20):.1f} "
            f"MiB in {len(bench.tensors)} float32 tensors, {args.runs} runs; torch "
            f"{torch.__version__}; files in {work} ({fstype(work)})",
            flush=True,
        )
        if bench.overlap_missing is not None:
            print(f"overlapped save: not available ({bench.overlap_missing})", flush=True)
        bench.warm_up()
        for run in range(args.runs):
            started = time.perf_counter()
            bench.run(run)
            shown = " ".join(f"{k}={v[-1]:.4f}" for k, v in bench.times.items() if v)
            spent = time.perf_counter() - started
            print(f"run {run + 1}/{args.runs} ({spent:.0f}s), seconds: {shown}", flush=True)
        medians = table(bench)
        return verdicts(bench, medians)


def verdicts(bench: DeviceBench, medians: dict[str, float]) -> dict[str, Any]:
    ratios: dict[str, float | None] = {
        "save_vs_pinned_d2h": medians["save"] / medians["floor_pinned_d2h"],
        "overlapped_blocked_vs_pinned_d2h": (
            medians["save_overlapped"] / medians["floor_pinned_d2h"]
            if "save_overlapped" in medians
            else None
        ),
        "restore_vs_pinned_h2d": medians["restore"] / medians["floor_pinned_h2d"],
    }
    info = {
        "save_vs_pageable_d2h": medians["save"] / medians["floor_pageable_d2h"],
        "restore_same_vs_pinned_h2d": medians["restore_same"] / medians["floor_pinned_h2d"],
        "save_vs_torch_save": medians["save"] / medians["torch_save"],
        "save_vs_dcp_async": medians["save"] / medians["dcp_async"],
        "blocking_save_step_cost_s": medians["step_blocking"] - medians["step_none"],
    }
    if "step_overlapped" in medians:
        info["overlapped_save_step_cost_s"] = medians["step_overlapped"] - medians["step_none"]
    passed: dict[str, bool] = {}
    print("\nratio (planaria / floor)               value   target")
    for key, value in ratios.items():
        if value is None:
            passed[key] = False
            print(f"  {key:<36} {'n/a':>7}  <= {TARGETS[key]:<5g} FAIL (overlapped save: "
                  f"not available: {bench.overlap_missing})")  # fmt: skip
            continue
        passed[key] = value <= TARGETS[key]
        verdict = "PASS" if passed[key] else "FAIL"
        print(f"  {key:<36} {value:>7.3f}  <= {TARGETS[key]:<5g} {verdict}")
    passed["bitwise"] = bool(bench.bitwise) and all(bench.bitwise)
    print(
        f"  {'every restore bitwise equal':<36} {len(bench.bitwise):>4} checks  "
        f"{'PASS' if passed['bitwise'] else 'FAIL'}"
    )
    print("\ninformation")
    for key, value in info.items():
        print(f"  {key:<36} {value:>8.4f}")
    return {
        **{k: (round(v, 4) if v is not None else None) for k, v in ratios.items()},
        **{k: round(v, 5) for k, v in info.items()},
        "pass": passed,
        "overlapped": bench.overlap_missing or "available",
        "medians_s": {k: round(v, 5) for k, v in medians.items()},
        "bytes": bench.bytes,
        "device": bench.dev.name,
        "runs": bench.args.runs,
    }
