"""Recovery time after a worker is killed: planaria run against torchrun, in one run.

The same training script (examples/train_gpt.py, DDP over gloo, 2 workers on one node) runs
under ``planaria run`` (1 node x 2 procs) and under ``torchrun --max-restarts 3`` (c10d
rendezvous), and worker rank 1 is SIGKILLed at the same step in each (``PLANARIA_CHAOS``, fired
inside the worker by ``planaria.monitor.step``). Trials are interleaved. torchrun runs twice:
at its defaults, and with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, the workaround for the
restarted workers reaching the killed worker's old store address.

MTTR: from the kill (the time the worker logs just before SIGKILL) to the first step rank 0
logs after it resumed. Steps lost: steps done before the kill that had to be done again (the
example saves a flash checkpoint to memory every step: under planaria run it restores from
memory; torchrun's restarted workers restore from the last persisted step).

It also times the cost of that checkpoint: the median step time of one training process saving
its state to memory every step, against the same run without a checkpoint.

Nothing is left running: every trial (planaria's and torchrun's, and each step-time run) has
a marker of its own in its environment (:mod:`planaria.leftovers`), which its workers keep even
when they leave the launcher's session or outlive it; after the trial whatever still carries
it is killed and named in a warning, and at the end the benchmark looks once more for all of
them (``left_behind`` in the JSON; ``survivors_killed`` counts what trials left).

Run:  python benchmarks/recovery.py [--trials 3] [--steps 60] [--kill-at 30]
The last line printed is one JSON object with the figures.

``--device cuda`` trains on the GPUs (NCCL, a larger model) and kills a worker both during a
save and between saves, against torchrun, with a bitwise check of the final weights
(benchmarks/recovery_device.py); ``--device cpu``, the default, is the benchmark above.

``--node-loss`` loses a whole node instead, with and without nodes standing by (``job.standby``),
against torchrun with the node started again (benchmarks/recovery_node.py).

``--scheduler slurm`` measures on a real Slurm cluster instead, a worker kill and a node loss
(benchmarks/recovery_slurm.py says how); ``--scheduler ray`` the same two on a Ray cluster of
this machine, against the local scheduler (benchmarks/recovery_ray.py).
"""

from __future__ import annotations

import argparse
import itertools
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

if not __package__:  # run as ``python benchmarks/recovery.py``: import through the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (
    EXAMPLE,
    STEP,
    TrialResult,
    chaos,
    exit_on_sigterm,
    interleave,
    measure,
    ratio,
    run_launcher,
    summarise,
    train_args,
)
from planaria import leftovers
from planaria.testing.processes import run_group


def run_planaria(args: argparse.Namespace, work: Path) -> TrialResult:
    config = work / "job.yaml"
    command = [sys.executable, *train_args(args, work / "ckpt")]
    config.write_text(
        json.dumps(
            {
                "job": {
                    "name": "bench",
                    "command": command,
                    "nodes": 1,
                    "procs_per_node": 2,
                    "max_restarts": 3,
                },
                "diagnosis": {"checks": []},
                "chaos": [{"kind": "kill_worker", "rank": 1, "at_step": args.kill_at}],
            }
        )
    )
    planaria = Path(sys.executable).parent / "planaria"
    started = time.time()
    try:
        proc = run_group([str(planaria), "run", str(config)], work, dict(os.environ), args.timeout)
        ok, note = proc.returncode == 0, proc.stdout[-300:] if proc.returncode else ""
    except subprocess.TimeoutExpired:
        ok, note = False, "timed out (hang)"
    wall = time.time() - started
    logs = next(work.glob("planaria-runs/*/logs"), None)
    if logs is None:
        return TrialResult(False, wall=wall, note="no run directory")
    rank0 = (logs / "rank-0.log").read_text(errors="replace")
    killed = (logs / "rank-1.log").read_text(errors="replace")
    return measure(rank0, killed, args.kill_at, ok, wall, note)


def run_torchrun(args: argparse.Namespace, work: Path, workaround: bool) -> TrialResult:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PLANARIA_CHAOS": chaos(args)}
    env.pop("PLANARIA_PROGRESS_FILE", None)
    if workaround:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [
        str(torchrun),
        "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "3",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
        *train_args(args, work / "ckpt"),
    ]  # fmt: skip
    ok, output, note, wall = run_launcher(command, work, env, args.timeout)
    return measure(output, output, args.kill_at, ok, wall, note)


def step_time(args: argparse.Namespace, work: Path, checkpoint: bool) -> float:
    """Median step time of one training process, saving to memory every step or not at all."""
    command = [
        sys.executable,
        str(EXAMPLE),
        "--steps",
        str(args.overhead_steps),
        *args.overhead_model.split(),
        "--ckpt-every",
        "0",  # memory only: what every step pays
        "--ckpt-dir",
        str(work / "ckpt"),
    ]
    if not checkpoint:
        command.append("--no-ckpt")
    env = {
        k: v
        for k, v in os.environ.items()
        if k == leftovers.VARIABLE or not k.startswith(("PLANARIA_", "RANK"))
    }
    proc = subprocess.run(
        command, cwd=work, env=env, capture_output=True, text=True, timeout=args.timeout
    )
    if proc.returncode:
        raise RuntimeError(f"training failed: {proc.stderr[-500:]}")
    times = [float(m["t"]) for line in proc.stdout.splitlines() if (m := STEP.match(line))]
    deltas = [b - a for a, b in itertools.pairwise(times)][5:]  # after warm-up
    return statistics.median(deltas)


def overhead(args: argparse.Namespace, sweeper: leftovers.Sweeper) -> dict[str, float]:
    """Step time with a flash checkpoint to memory every step against no checkpoint."""
    with_ckpt: list[float] = []
    without: list[float] = []
    for trial in range(args.overhead_trials):
        for checkpoint, into in ((False, without), (True, with_ckpt)):  # interleaved
            work = Path(tempfile.mkdtemp(prefix="planaria-bench-"))
            name = f"overhead trial {trial + 1} ({'with' if checkpoint else 'no'} checkpoint)"
            try:
                with sweeper.trial(name):
                    into.append(step_time(args, work, checkpoint))
            finally:
                shutil.rmtree(work, ignore_errors=True)
        print(
            f"overhead trial {trial + 1}: step {without[-1] * 1e3:.1f} ms without a checkpoint, "
            f"{with_ckpt[-1] * 1e3:.1f} ms saving to memory every step",
            flush=True,
        )
    base, saved = statistics.median(without), statistics.median(with_ckpt)
    # Each trial pairs two runs made one after the other: the median of their ratios is less
    # exposed to the machine's drift than the ratio of the medians.
    cost = statistics.median(w / b for w, b in zip(with_ckpt, without, strict=True)) - 1
    print(
        f"{'step time':<28} no checkpoint {base * 1e3:.1f} ms, memory every step "
        f"{saved * 1e3:.1f} ms: overhead {cost:+.1%} (median of the paired trials)"
    )
    return {"step_s": base, "step_with_ckpt_s": saved, "ckpt_overhead": cost}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=None, help="3 (on a device: 2)")
    parser.add_argument("--steps", type=int, default=None, help="60 (on a device: 30)")
    parser.add_argument("--kill-at", type=int, default=None, help="30 (on a device: 17)")
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="a run past it hangs (90 s; --node-loss: 180 s; device: 240 s)",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="with --device cuda: run its path with CPU workers (checks the script)",
    )
    parser.add_argument(
        "--gpu-model",
        default="--d-model 768 --layers 16 --heads 12 --seq 256 --batch 8",
        help="train_gpt.py model arguments with --device cuda (~1.4 GB of state)",
    )
    parser.add_argument(
        "--kill-delay", type=float, default=0.005, help="device: seconds into the killed save"
    )
    parser.add_argument("--overhead-steps", type=int, default=60)
    parser.add_argument("--overhead-trials", type=int, default=5)
    parser.add_argument(
        "--overhead-model",
        default="--d-model 256 --layers 4 --heads 8 --seq 64 --batch 8",
        help="train_gpt.py model arguments for the step-time overhead (one process)",
    )
    parser.add_argument(
        "--scheduler",
        choices=("local", "slurm", "ray"),
        default="local",
        help="slurm: planaria run inside an allocation against srun torchrun "
        "(recovery_slurm.py); ray: on a Ray cluster against the local scheduler (recovery_ray.py)",
    )
    parser.add_argument(
        "--procs-per-node",
        type=int,
        default=1,
        help="workers per node (--scheduler slurm or ray, --node-loss)",
    )
    parser.add_argument(
        "--node-loss",
        action="store_true",
        help="a node lost, with and without job.standby, against torchrun with the node "
        "started again (recovery_node.py)",
    )
    parser.add_argument(
        "--kill-rank",
        type=int,
        nargs="+",
        default=[1],
        help="--node-loss: the node rank(s) whose node planaria loses, a row each (1)",
    )
    parser.add_argument(
        "--store",
        nargs="+",
        choices=("rank0", "master"),
        default=["rank0"],
        help="--node-loss: rendezvous.store of the planaria rows, a row each (rank0)",
    )
    parser.add_argument(
        "--standby",
        type=int,
        nargs="+",
        default=[0],
        help="--node-loss: job.standby of the planaria rows, a row each (0; a row of rank 1, "
        "rank0 and 1 node standing by always runs)",
    )
    args = parser.parse_args()
    on_device = args.device != "cpu"
    if args.cpu_dry_run and not on_device:
        raise SystemExit("--cpu-dry-run runs the --device cuda path: give --device cuda with it")
    if args.node_loss and args.timeout is None:
        args.timeout = 180.0  # three launches of a node at least, on a busy machine
    for name, cpu, device in (
        ("trials", 3, 2),
        ("steps", 60, 30),
        ("kill_at", 30, 17),
        ("timeout", 90.0, 240.0),
    ):
        if getattr(args, name) is None:
            setattr(args, name, device if on_device else cpu)
    exit_on_sigterm()  # a kill still sweeps the trial
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    if args.node_loss:
        from benchmarks import recovery_node  # here: a benchmark of its own

        recovery_node.main(args)
        return
    if args.scheduler == "slurm":
        from benchmarks import recovery_slurm  # here: only this variant needs Slurm

        recovery_slurm.main(args)
        return
    if args.scheduler == "ray":
        from benchmarks import recovery_ray  # here: only this variant needs Ray

        recovery_ray.main(args)
        return
    with leftovers.Sweeper() as sweeper:  # checks at the end even if the benchmark fails
        if on_device:
            from benchmarks import recovery_device  # here: only this variant needs a GPU

            recovery_device.main(args, sweeper)
        else:
            compare(args, sweeper)


def compare(args: argparse.Namespace, sweeper: leftovers.Sweeper) -> None:
    """The trials, the overhead and the report."""
    runners: dict[str, Callable[[Path], TrialResult]] = {
        "planaria run": lambda work: run_planaria(args, work),
        "torchrun (defaults)": lambda work: run_torchrun(args, work, workaround=False),
        "torchrun (workaround)": lambda work: run_torchrun(args, work, workaround=True),
    }
    trials = interleave(args.trials, runners, sweeper)

    print()
    planaria = summarise("planaria run", trials["planaria run"])
    default = summarise("torchrun (defaults)", trials["torchrun (defaults)"])
    workaround = summarise("torchrun (workaround)", trials["torchrun (workaround)"])
    cost = overhead(args, sweeper)
    left = sweeper.final()
    against = ratio(planaria["mttr"], workaround["mttr"])
    print(
        json.dumps(
            {
                "planaria_mttr_s": planaria["mttr"],
                "torchrun_mttr_s": workaround["mttr"],
                "ratio": against,
                "steps_lost": planaria["steps_lost"],
                "planaria_failed": planaria["failed"],
                "torchrun_default_failed": default["failed"],
                "torchrun_default_mttr_s": default["mttr"],
                "trials": args.trials,
                **cost,
                "survivors_killed": len(sweeper.killed),
                "left_behind": len(left),
            }
        )
    )


if __name__ == "__main__":
    main()
