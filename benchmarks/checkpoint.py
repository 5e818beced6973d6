"""Flash checkpoint: how long training blocks to save, and how long a restore takes.

One state dict (default ~1 GiB of float32 CPU tensors: a model of a few large and many small
tensors, plus an Adam-like optimizer state with two moments per parameter) is saved and restored
by each method below, one after another in every run (interleaved: machine drift hits all alike;
the floor and the steady save swap places every other run), ``--runs`` times in one process; the
table shows the median, min and max of each, and one line per run shows every figure.

Save (the time training is blocked):

- ``memcpy floor``: copy every tensor (``torch`` ``copy_``) into a /dev/shm file mapped once
  and pre-faulted once (every page written), reused by every run. Nothing can save faster.
- ``planaria save, steady``: :meth:`Checkpointer.save` (``persist=False``) once its segment
  exists, i.e. any save but the first.
- ``planaria first save, prepare() ahead``: a new Checkpointer on a new segment, whose
  ``prepare(state)`` ran and finished pre-faulting first, as a training loop does by calling
  ``prepare`` before (or during) its first steps.
- ``planaria first save, no prepare`` (information): the same without ``prepare``: the save
  creates the segment, and its copy allocates the shared memory's pages.
- ``planaria save, persist=True`` (information): the blocking part of a save that is also handed
  to the persister process (it pins the slot, then writes to disk in the background; the
  benchmark waits for that outside the timing, and fails unless the step was committed).
- ``torch.save + fsync``: ``torch.save`` to a new file on disk, flushed and fsynced.
- ``dcp.async_save``: ``torch.distributed.checkpoint.async_save`` (defaults, a single-process
  gloo group) until it returns its future; the future is awaited outside the timing.

Restore (every restore fills existing, pre-faulted tensors in place, except torch.load):

- ``memcpy floor``: copy every tensor back from the pre-faulted buffer.
- ``planaria load, same process``: :meth:`Checkpointer.load` by the Checkpointer that saved
  (its mapping of the segment is warm).
- ``planaria load, new Checkpointer``: a new Checkpointer in this process, set up as a managed
  worker (``PLANARIA_CKPT_SEGMENT``/``SOCKET``/``STORAGE``, ``PLANARIA_CKPT_RESTORE=memory:N``),
  that maps the existing segment afresh.
- ``planaria load, restarted worker``: the same in a new Python process (torch imported and the
  target tensors allocated before the timing), which is what a restarted worker does; the
  restored values are checked against the saved ones. The ratios use this one.
- ``torch.load warm``: ``torch.load(weights_only=True, map_location="cpu")`` of the file
  ``torch.save`` wrote (in the page cache).

Files go to a temporary directory on the repository's disk (``--dir`` to choose another;
never tmpfs); everything the benchmark creates is removed at the end, also on error. So are its
processes: the whole run (the persister) and each restarted worker have a marker of their own
in their environment (:mod:`planaria.leftovers`); what still carries one after its part is
killed and named, and the end looks once more for all of them (``left_behind`` in the JSON).

Run:  python benchmarks/checkpoint.py [--size-mib 1024] [--tensors 200] [--runs 5]
                                      [--threads N] [--dir PARENT] [--seed 0]
(``--threads``: torch's intra-op threads, here and in the restarted worker; default torch's.)

``--device cuda`` (or ``cuda:N``) benchmarks a state of device tensors instead (default 4 GiB)
against the device's copy floors: see ``benchmarks/checkpoint_device.py``. ``--device cpu``
(the default) is the benchmark described here.
The last line printed is one JSON object: the ratios (planaria's time divided by the other's),
whether each meets its target, the medians in seconds and the size.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

if not __package__:  # run as ``python benchmarks/checkpoint.py``: import through the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import exit_on_sigterm, fstype, leaves, make_state
from planaria import leftovers
from planaria.log import configure as configure_logging

ROOT = Path(__file__).resolve().parent.parent
ALIGN = 64
TARGETS = {
    "save_vs_floor": 1.10,
    "first_save_vs_floor": 2.0,
    "restore_vs_floor": 1.3,
    "save_vs_torch_save": 0.10,
    "save_vs_dcp_async": 1.0,
    "restore_vs_torch_load": 0.125,
}
CHECKED = 4
"""How many tensors (spread over the state) the restarted worker checks against the saved ones."""


# -- the state -----------------------------------------------------------------------------------


def fingerprint(tensors: list[torch.Tensor]) -> list[float]:
    """Sums of a few tensors spread over the state: what the restarted worker compares."""
    picks = sorted({round(i * (len(tensors) - 1) / max(CHECKED - 1, 1)) for i in range(CHECKED)})
    return [float(tensors[i].double().sum()) for i in picks]


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# -- the floor -----------------------------------------------------------------------------------


class Floor:
    """A /dev/shm buffer mapped and pre-faulted once; every run copies the state into it."""

    def __init__(self, tensors: list[torch.Tensor], path: Path) -> None:
        offsets, offset = [], 0
        for t in tensors:
            offsets.append(offset)
            offset = _align(offset + t.numel() * t.element_size())
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.ftruncate(self._fd, max(offset, mmap.PAGESIZE))
        self._map = mmap.mmap(self._fd, max(offset, mmap.PAGESIZE))
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        whole.fill_(0)  # pre-fault: every page allocated and mapped
        self.views = [
            whole[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for o, t in zip(offsets, tensors, strict=True)
        ]
        del whole

    def save(self, tensors: list[torch.Tensor]) -> None:
        for dst, src in zip(self.views, tensors, strict=True):
            dst.copy_(src)

    def restore(self, tensors: list[torch.Tensor]) -> None:
        for dst, src in zip(tensors, self.views, strict=True):
            dst.copy_(src)

    def close(self) -> None:
        self.views = []
        gc.collect()
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


# -- helpers -------------------------------------------------------------------------------------


def timed(action: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    started = time.perf_counter()
    result = action()
    return time.perf_counter() - started, result


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def disk_dir(requested: str | None) -> Path:
    """A parent for the temporary directory: on the repository's disk, never tmpfs."""
    if requested is not None:
        parent = Path(requested)
    else:
        tmp = Path(tempfile.gettempdir())
        parent = tmp if os.stat(tmp).st_dev == os.stat(ROOT).st_dev else ROOT
    kind = fstype(parent)
    if kind in {"tmpfs", "ramfs"}:
        raise SystemExit(f"--dir {parent} is on {kind}: torch.save must go to a disk")
    return parent


# -- the restarted worker (a child process) ------------------------------------------------------


def restore_child(args: argparse.Namespace) -> None:
    """Build the target state, time one ``Checkpointer.load`` from memory, report as JSON."""
    from planaria.checkpoint import Checkpointer

    target = make_state(args.size_mib, args.tensors, args.seed, fill=False)
    ckpt = Checkpointer()
    try:
        seconds, result = timed(lambda: ckpt.load(target))
        source = ckpt.restored_from
    finally:
        ckpt.close()
    step = result[0] if result is not None else None
    print(
        json.dumps(
            {
                "seconds": seconds,
                "source": source,
                "step": step,
                "fingerprint": fingerprint(leaves(target)),
            }
        ),
        flush=True,
    )


# -- the benchmark -------------------------------------------------------------------------------


SAVE_ROWS = [
    ("floor_save", "memcpy floor (pre-faulted shm buffer)"),
    ("save", "planaria save, steady"),
    ("first_save", "planaria first save, prepare() ahead"),
    ("first_save_cold", "planaria first save, no prepare (info)"),
    ("save_persist", "planaria save, persist=True (info)"),
    ("torch_save", "torch.save + flush + fsync"),
    ("dcp_async", "dcp.async_save (until it returns)"),
]
RESTORE_ROWS = [
    ("floor_restore", "memcpy floor (from the shm buffer)"),
    ("restore_same", "planaria load, same process"),
    ("restore_new", "planaria load, new Checkpointer"),
    ("restore", "planaria load, restarted worker"),
    ("torch_load", "torch.load warm (page cache)"),
]


class Bench:
    def __init__(
        self,
        args: argparse.Namespace,
        work: Path,
        stack: contextlib.ExitStack,
        sweeper: leftovers.Sweeper,
    ) -> None:
        from planaria.checkpoint import Checkpointer

        self.args = args
        self.sweeper = sweeper
        self.work = work
        self.stack = stack
        self.Checkpointer = Checkpointer
        self.times: dict[str, list[float]] = {key: [] for key, _ in SAVE_ROWS + RESTORE_ROWS}
        self.state = make_state(args.size_mib, args.tensors, args.seed, fill=True)
        self.tensors = leaves(self.state)
        self.bytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.expected = fingerprint(self.tensors)
        self.target = make_state(args.size_mib, args.tensors, args.seed, fill=False)
        self.target_tensors = leaves(self.target)
        self.storage = work / "storage"
        self.spec = {"backend": "local", "options": {"path": str(self.storage)}}
        self.prefix = f"planaria-bench-{os.getpid()}"
        self.floor = Floor(self.tensors, Path("/dev/shm") / f"{self.prefix}-floor")
        stack.callback(self.floor.close)
        self.ckpt = self.new_checkpointer("steady")
        self.step = 0
        self.files: list[Path] = []

    def new_checkpointer(self, name: str) -> Any:
        ckpt = self.Checkpointer(self.spec)  # its segment: in a private directory of its own
        self.stack.callback(ckpt.close)
        return ckpt

    def next_step(self) -> int:
        self.step += 1
        return self.step

    def record(self, key: str, seconds: float) -> None:
        self.times[key].append(seconds)

    # -- save ----------------------------------------------------------------------------------

    def warm_up(self) -> None:
        self.ckpt.save(self.next_step(), self.state, persist=False)  # creates the segment
        step = self.next_step()
        self.ckpt.save(step, self.state, persist=True)  # starts the persister
        self.persisted(step)
        self.floor.save(self.tensors)
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            store=dist.FileStore(str(self.work / "pg-store"), 1),  # type: ignore[attr-defined]
            rank=0,
            world_size=1,
        )
        self.stack.callback(dist.destroy_process_group)
        self.dcp_async(self.work / "dcp-warm-up")  # its first call sets up more than later ones

    def run_saves(self, run: int) -> None:
        step = self.next_step()
        pair = [
            ("floor_save", lambda: self.floor.save(self.tensors)),
            ("save", lambda: self.ckpt.save(step, self.state, persist=False)),
        ]
        for key, action in pair if run % 2 == 0 else reversed(pair):  # neither always first
            self.record(key, timed(action)[0])

        fresh = self.new_checkpointer(f"first-{run}")
        fresh.prepare(self.state)
        fresh._segment.wait_prefault()
        self.record("first_save", timed(lambda: fresh.save(step, self.state, persist=False))[0])
        fresh.close()

        cold = self.new_checkpointer(f"cold-{run}")
        self.record("first_save_cold", timed(lambda: cold.save(step, self.state, persist=False))[0])
        cold.close()

        step = self.next_step()
        self.record(
            "save_persist", timed(lambda: self.ckpt.save(step, self.state, persist=True))[0]
        )
        self.persisted(step)  # the persister finished writing: outside the timing

        path = self.work / f"torch-{run}.pt"
        self.record("torch_save", timed(lambda: self.torch_save(path))[0])
        for old in self.files:
            old.unlink()
        self.files = [path]

        self.record("dcp_async", self.dcp_async(self.work / f"dcp-{run}"))

    def persisted(self, step: int) -> None:
        """Wait for the persister; fail unless ``step`` was committed (a save whose persist
        failed only logs a warning, and its blocking time would mean nothing)."""
        self.ckpt.wait()
        if not (self.storage / f"step-{step}" / "manifest.json").is_file():
            raise RuntimeError(f"step {step} was not persisted (see the warning above)")

    def torch_save(self, path: Path) -> None:
        with open(path, "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())

    def dcp_async(self, path: Path) -> float:
        import torch.distributed.checkpoint as dcp

        seconds, future = timed(
            lambda: dcp.async_save(self.state, checkpoint_id=str(path))  # type: ignore[attr-defined]
        )
        result = getattr(future, "upload_completion", future)  # an AsyncSaveResponse or a Future
        result.result()
        shutil.rmtree(path)
        return seconds

    # -- restore -------------------------------------------------------------------------------

    def run_restores(self, run: int) -> None:
        self.record("floor_restore", timed(lambda: self.floor.restore(self.target_tensors))[0])

        seconds, result = timed(lambda: self.ckpt.load(self.target))
        self.check(result, self.ckpt.restored_from, "same process")
        self.record("restore_same", seconds)

        with environment(self.managed_env()):
            new = self.Checkpointer()
            try:
                seconds, result = timed(lambda: new.load(self.target))
                self.check(result, new.restored_from, "new Checkpointer")
            finally:
                new.close()
        self.record("restore_new", seconds)

        with self.sweeper.trial(f"the restarted worker of run {run + 1}"):
            self.record("restore", self.restore_in_child())

        path = self.files[-1]
        seconds, loaded = timed(lambda: torch.load(path, weights_only=True, map_location="cpu"))
        if fingerprint(leaves(loaded)) != self.expected:
            raise RuntimeError("torch.load returned other values than were saved")
        del loaded
        self.record("torch_load", seconds)

    def managed_env(self) -> dict[str, str]:
        return {
            "PLANARIA_CKPT_SEGMENT": str(self.ckpt.segment_path),
            "PLANARIA_CKPT_SOCKET": str(self.work / "no-persister.sock"),
            "PLANARIA_CKPT_STORAGE": json.dumps(self.spec),
            "PLANARIA_CKPT_RESTORE": f"memory:{self.step}",
        }

    def check(self, result: Any, source: str | None, what: str) -> None:
        if result is None or result[0] != self.step or source != "memory":
            raise RuntimeError(f"{what}: restored {result and result[0]} from {source}")
        if fingerprint(self.target_tensors) != self.expected:
            raise RuntimeError(f"{what}: the restored values differ from the saved ones")
        for t in self.target_tensors[:: max(1, len(self.target_tensors) // 8)]:
            t.zero_()  # the next restore must really write

    def restore_in_child(self) -> float:
        env = {**os.environ, **self.managed_env(), "PYTHONUNBUFFERED": "1"}
        env.pop("RANK", None)
        env.pop("WORLD_SIZE", None)
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--restore-child",
            "--size-mib", str(self.args.size_mib),
            "--tensors", str(self.args.tensors),
            "--seed", str(self.args.seed),
            "--threads", str(self.args.threads),
        ]  # fmt: skip
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"the restarted worker failed: {proc.stderr.strip()[-2000:]}")
        report = json.loads(lines[-1])
        if report["source"] != "memory" or report["step"] != self.step:
            raise RuntimeError(f"the restarted worker restored {report}")
        if report["fingerprint"] != self.expected:
            raise RuntimeError("the restarted worker restored other values than were saved")
        return float(report["seconds"])


# -- the report ----------------------------------------------------------------------------------


def table(bench: Bench) -> dict[str, float]:
    medians = {key: statistics.median(v) for key, v in bench.times.items()}
    gib = bench.bytes / (1 << 30)
    for title, rows in (("save (training blocked)", SAVE_ROWS), ("restore", RESTORE_ROWS)):
        print(f"\n{title:<42} {'median':>9} {'min':>9} {'max':>9} {'GiB/s':>7}")
        for key, label in rows:
            values = bench.times[key]
            print(
                f"  {label:<40} {medians[key]:>8.4f}s {min(values):>8.4f}s "
                f"{max(values):>8.4f}s {gib / medians[key]:>7.2f}"
            )
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size-mib", type=float, default=None, help="state size (MiB; 1024, 4096 on a device)"
    )
    parser.add_argument(
        "--device", default="cpu", help="where the state lives: cpu (default), cuda, cuda:N"
    )
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="with --device cuda: run the device benchmark on CPU tensors (checks the script)",
    )
    parser.add_argument("--steps", type=int, default=10, help="device: training steps per mode")
    parser.add_argument("--step-matmuls", type=int, default=40, help="device: matmuls per step")
    parser.add_argument("--step-size", type=int, default=8192, help="device: matmul size")
    parser.add_argument("--tensors", type=int, default=200, help="number of tensors in the state")
    parser.add_argument(
        "--runs", type=int, default=None, help="interleaved runs (medians; 5, 3 on a device)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="parent of the temporary directory (a disk)")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (default: torch's choice)"
    )
    parser.add_argument("--restore-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads < 0:
        raise SystemExit(f"--threads must be positive (0: torch's default): {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    on_device = args.device != "cpu"
    if args.cpu_dry_run and not on_device:
        raise SystemExit("--cpu-dry-run runs the device benchmark: give --device cuda with it")
    if args.runs is None:
        args.runs = 3 if on_device else 5
    if args.size_mib is None and not on_device:
        args.size_mib = 1024.0
    if args.restore_child:
        if on_device:
            from benchmarks.checkpoint_device import restore_child as device_restore_child

            device_restore_child(args)
        else:
            restore_child(args)
        return
    if args.runs < 1:
        raise SystemExit(f"--runs must be at least 1: {args.runs}")
    exit_on_sigterm()  # clean up on a kill, too

    parent = disk_dir(args.dir)
    configure_logging(level="warning")  # the restarted worker logs as a worker does
    with leftovers.Sweeper() as sweeper:  # checks at the end even if the benchmark fails
        with sweeper.trial("the benchmark (its persister)"):
            if on_device:
                from benchmarks.checkpoint_device import run_device

                result = run_device(args, parent)
            else:
                result = measure(args, parent, sweeper)
        left = sweeper.final()
    print(json.dumps({**result, "survivors_killed": len(sweeper.killed), "left_behind": len(left)}))


def measure(args: argparse.Namespace, parent: Path, sweeper: leftovers.Sweeper) -> dict[str, Any]:
    """Every run, the tables and the verdicts; the JSON report (main prints it)."""
    with contextlib.ExitStack() as stack:
        work = Path(tempfile.mkdtemp(prefix="planaria-bench-ckpt-", dir=parent))
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        bench = Bench(args, work, stack, sweeper)
        print(
            f"flash checkpoint: {bench.bytes / (1 << 20):.1f} MiB in {len(bench.tensors)} float32 "
            f"tensors (model + optimizer moments), {args.runs} interleaved runs; torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads; files in {work} "
            f"({fstype(work)})",
            flush=True,
        )
        bench.warm_up()
        for run in range(args.runs):
            started = time.perf_counter()
            bench.run_saves(run)
            bench.run_restores(run)
            spent = time.perf_counter() - started
            shown = " ".join(f"{key}={values[-1]:.3f}" for key, values in bench.times.items())
            print(f"run {run + 1}/{args.runs} ({spent:.0f}s), seconds: {shown}", flush=True)
        medians = table(bench)
        print(
            "\nfirst save, prepare() ahead: Checkpointer.prepare(state) ran and its background\n"
            "pre-fault finished before the save, as when a training loop calls prepare() during\n"
            "its first steps. restore_vs_* use the restarted worker (a new process)."
        )
        ratios = {
            "save_vs_floor": medians["save"] / medians["floor_save"],
            "first_save_vs_floor": medians["first_save"] / medians["floor_save"],
            "restore_vs_floor": medians["restore"] / medians["floor_restore"],
            "save_vs_torch_save": medians["save"] / medians["torch_save"],
            "save_vs_dcp_async": medians["save"] / medians["dcp_async"],
            "restore_vs_torch_load": medians["restore"] / medians["torch_load"],
        }
        passed = {k: v <= TARGETS[k] for k, v in ratios.items()}
        print("\nratio (planaria / other)     value   target")
        for key, value in ratios.items():
            verdict = "PASS" if passed[key] else "FAIL"
            print(f"  {key:<25} {value:>7.3f}  <= {TARGETS[key]:<6g} {verdict}")
        return {
            **{k: round(v, 4) for k, v in ratios.items()},
            "pass": passed,
            "medians_s": {k: round(v, 5) for k, v in medians.items()},
            "bytes": bench.bytes,
            "tensors": len(bench.tensors),
            "runs": args.runs,
        }


if __name__ == "__main__":
    main()
