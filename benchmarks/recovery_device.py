"""Recovery on GPUs: ``benchmarks/recovery.py --device cuda``.

examples/train_gpt.py trains on ``cuda:LOCAL_RANK`` (NCCL, ``--deterministic``) with a model
whose state takes a measurable time to save (``--gpu-model``: about 1.4 GB of weights and Adam
moments by default), one worker per GPU (at most ``--procs``; one GPU: one worker). The last
rank is SIGKILLed at ``--kill-at``:

- ``during a save``: ``--kill-delay`` seconds into its save of that step (train_gpt.py's
  ``--kill-in-save``): the newest completed save is the step before, so a restore of it loses
  no step. When the restored step shows the kill came after the save had completed, the trial
  says so (the window was missed; raise the model size or lower the delay).
- ``between saves``: by planaria's chaos rule, right after the save of that step completed.

``planaria run`` and ``torchrun --max-restarts 3`` (c10d, with the store workaround, as in the
CPU benchmark) each take every kill, interleaved. MTTR: from the kill to the first step rank 0
logs after the restart; steps lost: completed saves that were not restored. Bitwise: every
planaria trial's final weights (``--out``) against a run without a kill.

Targets (PASS/FAIL): a kill during a save loses 0 steps, and planaria recovers from it in at
most 0.2x torchrun's time in the same run; every recovered run ends bitwise equal to the
fault-free one.

``--cpu-dry-run`` runs this path with ``--device cpu`` workers (gloo; the small CPU model):
it checks the script where there is no GPU; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if not __package__:  # loaded by its path, not as benchmarks.NAME: import through the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (
    EXAMPLE,
    RESUMED,
    TrialResult,
    interleave,
    measure,
    ratio,
    run_launcher,
    summarise,
)
from planaria import leftovers
from planaria.testing.processes import run_group

MTTR_TARGET = 0.2


def gpus() -> int:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(
            f"--device cuda: torch cannot use CUDA here (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}); run on a GPU machine, or pass --cpu-dry-run"
        )
    return int(torch.cuda.device_count())


def train_args(args: argparse.Namespace, work: Path, during: bool) -> list[str]:
    device = "cpu" if args.cpu_dry_run else "cuda"
    model = [] if args.cpu_dry_run else args.gpu_model.split()
    kill = [
        "--kill-in-save", str(args.kill_at),
        "--kill-rank", str(args.procs - 1),
        "--kill-delay", str(args.kill_delay),
    ] if during else []  # fmt: skip
    return [
        str(EXAMPLE),
        "--steps", str(args.steps),
        "--ckpt-every", str(args.ckpt_every),
        "--ckpt-dir", str(work / "ckpt"),
        "--out", str(work / "final.pt"),
        "--device", device,
        "--deterministic",
        *model,
        *kill,
    ]  # fmt: skip


def chaos_rule(args: argparse.Namespace) -> dict[str, object]:
    return {"kind": "kill_worker", "rank": args.procs - 1, "at_step": args.kill_at}


def run_planaria(args: argparse.Namespace, work: Path, kill: str | None) -> TrialResult:
    """``kill``: "during" a save, "between" saves, or None (the fault-free reference)."""
    config = work / "job.yaml"
    config.write_text(
        json.dumps(
            {
                "job": {
                    "name": "bench",
                    "command": [sys.executable, *train_args(args, work, kill == "during")],
                    "nodes": 1,
                    "procs_per_node": args.procs,
                    "max_restarts": 3,
                },
                "diagnosis": {"checks": []},
                "chaos": [chaos_rule(args)] if kill == "between" else [],
            }
        )
    )
    # -m, not the console scripts: with wheels installed by pip --target (benchmarks/gpu.sh)
    # they are not beside the interpreter.
    started = time.time()
    try:
        command = [sys.executable, "-m", "planaria", "run", str(config)]
        proc = run_group(command, work, dict(os.environ), args.timeout)
        ok, note = proc.returncode == 0, proc.stdout[-300:] if proc.returncode else ""
    except subprocess.TimeoutExpired:
        ok, note = False, "timed out (hang)"
    wall = time.time() - started
    logs = next(work.glob("planaria-runs/*/logs"), None)
    if logs is None:
        return TrialResult(False, wall=wall, note="no run directory")
    if kill is None:
        return TrialResult(ok, wall=wall, note=note)
    rank0 = (logs / "rank-0.log").read_text(errors="replace")
    killed = (logs / f"rank-{args.procs - 1}.log").read_text(errors="replace")
    return judged(args, rank0, killed, ok, wall, note, kill)


def run_torchrun(args: argparse.Namespace, work: Path, kill: str) -> TrialResult:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env.pop("PLANARIA_PROGRESS_FILE", None)
    if kill == "between":
        env["PLANARIA_CHAOS"] = json.dumps([chaos_rule(args)])
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", str(args.procs), "--max-restarts", "3",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
        *train_args(args, work, kill == "during"),
    ]  # fmt: skip
    ok, output, note, wall = run_launcher(command, work, env, args.timeout)
    return judged(args, output, output, ok, wall, note, kill)


def judged(
    args: argparse.Namespace, rank0: str, killed: str, ok: bool, wall: float, note: str, kill: str
) -> TrialResult:
    """MTTR and the completed saves not restored. A kill during the save of step N finds N-1
    as the newest completed save; one that finds N restored came after the save completed."""
    saved = args.kill_at - 1 if kill == "during" else args.kill_at
    trial = measure(rank0, killed, saved, ok, wall, note)
    resumed = [int(m["step"]) for line in rank0.splitlines() if (m := RESUMED.match(line.strip()))]
    if trial.ok and kill == "during" and resumed and resumed[0] >= args.kill_at:
        trial.note = "the kill came after the save completed (window missed)"
    return trial


def same_weights(reference: Path, other: Path) -> bool:
    import torch

    a = torch.load(reference, weights_only=True, map_location="cpu")
    b = torch.load(other, weights_only=True, map_location="cpu")
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main(args: argparse.Namespace, sweeper: leftovers.Sweeper) -> None:
    count = 2 if args.cpu_dry_run else gpus()
    args.procs = max(1, min(2, count))  # one worker per GPU, two at most
    if args.kill_at >= args.steps - 1:
        raise SystemExit(f"--kill-at {args.kill_at} must be before the last step ({args.steps})")
    keep = Path(tempfile.mkdtemp(prefix="planaria-bench-finals-"))
    try:
        compare(args, sweeper, keep)
    finally:
        shutil.rmtree(keep, ignore_errors=True)


def compare(args: argparse.Namespace, sweeper: leftovers.Sweeper, keep: Path) -> None:
    print(
        f"recovery on {'cpu (dry run)' if args.cpu_dry_run else 'cuda'}: {args.procs} worker(s), "
        f"{args.steps} steps, kill of rank {args.procs - 1} at step {args.kill_at}, "
        f"{args.trials} trial(s)",
        flush=True,
    )
    finals: list[Path] = []

    def planaria(kill: str | None) -> Callable[[Path], TrialResult]:
        def run(work: Path) -> TrialResult:
            trial = run_planaria(args, work, kill)
            final = work / "final.pt"
            if final.is_file():  # kept past the work directory, for the bitwise check
                kept = keep / f"final-{kill or 'reference'}-{len(finals)}.pt"
                final.rename(kept)
                finals.append(kept)
            return trial

        return run

    work = Path(tempfile.mkdtemp(prefix="planaria-bench-"))
    try:
        with sweeper.trial("the fault-free reference run"):
            reference = planaria(None)(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not reference.ok or not finals:
        raise SystemExit(f"the fault-free reference run failed: {reference.note}")
    print(f"reference run, no kill: done (wall {reference.wall:.1f}s)", flush=True)
    runners: dict[str, Callable[[Path], TrialResult]] = {
        "planaria run (kill during a save)": planaria("during"),
        "torchrun (kill during a save)": lambda work: run_torchrun(args, work, "during"),
        "planaria run (kill between saves)": planaria("between"),
        "torchrun (kill between saves)": lambda work: run_torchrun(args, work, "between"),
    }
    trials = interleave(args.trials, runners, sweeper)
    print()
    summary = {name: summarise(name, found) for name, found in trials.items()}
    for name, found in trials.items():
        for trial in found:
            if trial.ok and trial.note:
                print(f"  note, {name}: {trial.note}")

    during, torch_during = (
        summary["planaria run (kill during a save)"],
        summary["torchrun (kill during a save)"],
    )
    against = ratio(during["mttr"], torch_during["mttr"])
    lost = [t.steps_lost for t in trials["planaria run (kill during a save)"] if t.ok]
    bitwise = [same_weights(finals[0], f) for f in finals[1:]]
    verdicts = {
        "kill_during_save_loses_0_steps": bool(lost) and all(n == 0 for n in lost),
        "mttr_vs_torchrun": against is not None and against <= MTTR_TARGET,
        "bitwise_equal_to_fault_free": bool(bitwise) and all(bitwise),
    }
    print("\ntarget                                  value        verdict")
    print(
        f"  {'kill during a save: steps lost':<37} {lost!s:<12} "
        f"{'PASS' if verdicts['kill_during_save_loses_0_steps'] else 'FAIL'}"
    )
    shown = "n/a" if against is None else f"{against:.3f}x"
    print(
        f"  {'MTTR during a save vs torchrun':<37} {shown:<12} <= {MTTR_TARGET}x "
        f"{'PASS' if verdicts['mttr_vs_torchrun'] else 'FAIL'}"
    )
    print(
        f"  {'final weights bitwise = no kill':<37} {sum(bitwise)}/{len(bitwise):<10} "
        f"{'PASS' if verdicts['bitwise_equal_to_fault_free'] else 'FAIL'}"
    )
    left = sweeper.final()
    print(
        json.dumps(
            {
                "device": "cpu (dry run)" if args.cpu_dry_run else "cuda",
                "procs": args.procs,
                "planaria_during_mttr_s": during["mttr"],
                "torchrun_during_mttr_s": torch_during["mttr"],
                "ratio": against,
                "steps_lost_during": lost,
                "runners": summary,
                "pass": verdicts,
                "trials": args.trials,
                "survivors_killed": len(sweeper.killed),
                "left_behind": len(left),
            }
        )
    )
