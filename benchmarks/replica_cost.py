"""What a peer replica (``checkpoint.replica``) costs: the step time of a job that copies every
saved step to its buddy node, against the same job without, in one run; and what copying
1 GiB of one node's state costs (time, and CPU time of the sender and the receiver).

Step time: examples/train_gpt.py under ``planaria run`` on the local scheduler, 2 nodes x
``--procs-per-node`` workers, a flash checkpoint to memory every step; ``replica`` adds
``checkpoint.replica: {every: 1}``, so each node copies every saved step to the other. The
figure is the median of rank 0's step times between ``--skip`` and the end (rank 0's log
stamps each step), per trial; trials of the two are interleaved, and the overhead is the
median of the paired trials' ratios.

Copy: a segment of ``--copy-gib`` GiB (one saved step) is copied by a :class:`ReplicaSender`
to a :class:`ReplicaServer` over loopback, in this process, ``--copies`` times: the wall time
of a copy and the CPU time of this process (both ends) per copy.

    python benchmarks/replica_cost.py [--trials 3] [--steps 80] [--copy-gib 1]

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as ``python benchmarks/replica_cost.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import STEP, TrialResult, interleave, launch, note_of, rank0_log
from planaria import leftovers


def step_times(log: str, skip: int) -> list[float]:
    """Rank 0's step durations after step ``skip``, from the times its log stamps."""
    stamps = [
        (int(m["step"]), float(m["t"])) for line in log.splitlines() if (m := STEP.match(line))
    ]
    return [b[1] - a[1] for a, b in itertools.pairwise(stamps) if a[0] >= skip]


def run_job(args: argparse.Namespace, work: Path, replica: bool) -> TrialResult:
    config = {
        "job": {
            "name": "bench",
            "command": [
                sys.executable,
                str(Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"),
                "--steps",
                str(args.steps),
                "--ckpt-every",
                str(args.steps),
                "--ckpt-dir",
                str(work / "ckpt"),
                *args.model.split(),
            ],
            "nodes": 2,
            "procs_per_node": args.procs_per_node,
        },
        "diagnosis": {"checks": []},
        "checkpoint": {"replica": {"every": 1}} if replica else {},
    }
    (work / "job.yaml").write_text(json.dumps(config))
    planaria = str(Path(sys.executable).parent / "planaria")
    started = time.time()
    ok, output, _ = launch([planaria, "run", str(work / "job.yaml")], work, dict(os.environ), 600)
    times = step_times(rank0_log(work), args.skip)
    if not ok or not times:
        return TrialResult(False, wall=time.time() - started, note=note_of(ok, output))
    # The trial's figure is its median step time (in the field the recovery trials use).
    return TrialResult(True, mttr=statistics.median(times), wall=time.time() - started)


def copy_cost(gib: float, copies: int) -> dict[str, float]:
    """Copy a ``gib`` GiB step from a segment to a replica server ``copies`` times; the median
    seconds a copy takes, and the CPU seconds this process spent per copy (both ends)."""
    from planaria.checkpoint.replica import ReplicaSender, ReplicaServer
    from planaria.checkpoint.segment import Segment
    from planaria.protocol import ReplicaEndpoint
    from planaria.shm import SHM_DIR, make_private_dir, name_prefix, remove_dir

    size = int(gib * (1 << 30))
    base = make_private_dir(SHM_DIR / f"{name_prefix()}bench-replica-{os.getpid()}")
    (base / "buddy").mkdir(mode=0o700)
    try:
        own = Segment.create(base / "ckpt-0", size + 4096)
        server = ReplicaServer(base / "buddy", "token", "127.0.0.1")
        sender = ReplicaSender(lambda _: base / "ckpt-0", 1, "token", "bench")
        walls, cpus = [], []
        fill = bytes(range(256)) * (1 << 14)
        try:
            for step in range(copies):
                with own.writing_bytes() as (slot, view):
                    for start in range(0, size, len(fill)):  # a save's pages, all written
                        view[start : start + len(fill)] = fill[: size - start]
                    own.publish(slot, step=step, rank=0, world=2, data_len=size, meta=b"{}")
                cpu, wall = time.process_time(), time.perf_counter()
                sender.target(
                    ReplicaEndpoint(node_id="b", addr="127.0.0.1", port=server.port), step
                )
                while not any(h.steps and h.steps[0] == step for h in server.holdings()):
                    time.sleep(0.005)
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
        finally:
            sender.close()
            server.close()
            own.close()
    finally:
        remove_dir(base)
    return {"copy_s": statistics.median(walls), "copy_cpu_s": statistics.median(cpus)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--skip", type=int, default=20, help="steps left out (warm-up)")
    parser.add_argument("--procs-per-node", type=int, default=1)
    parser.add_argument("--model", default="", help="train_gpt.py model arguments")
    parser.add_argument("--copy-gib", type=float, default=1.0)
    parser.add_argument("--copies", type=int, default=3)
    args = parser.parse_args()
    with leftovers.Sweeper() as sweeper:
        runners = {
            "no replica": lambda w: run_job(args, w, replica=False),
            "replica": lambda w: run_job(args, w, replica=True),
        }
        trials = interleave(args.trials, runners, sweeper, figure="step")
        pairs = [
            (a.mttr, b.mttr)
            for a, b in zip(trials["no replica"], trials["replica"], strict=True)
            if a.ok and b.ok and a.mttr and b.mttr
        ]
        result: dict[str, object] = {"trials": args.trials, "paired": len(pairs)}
        if pairs:
            base = statistics.median(a for a, _ in pairs)
            with_replica = statistics.median(b for _, b in pairs)
            cost = statistics.median(b / a - 1 for a, b in pairs)
            print(
                f"\nstep time (median of rank 0's steps, median of trials): {base * 1e3:.1f} ms "
                f"without a replica, {with_replica * 1e3:.1f} ms with one every step: "
                f"overhead {cost:+.1%} (median of the paired trials)"
            )
            result |= {"step_s": base, "step_with_replica_s": with_replica, "overhead": cost}
        copied = copy_cost(args.copy_gib, args.copies)
        rate = args.copy_gib * (1 << 30) / copied["copy_s"] / 1e9
        print(
            f"copy of {args.copy_gib:g} GiB to the buddy over loopback: {copied['copy_s']:.2f} s "
            f"({rate:.2f} GB/s), {copied['copy_cpu_s']:.2f} CPU-s (sender and receiver)"
        )
        result |= {"copy_gib": args.copy_gib, **copied}
        result["left_behind"] = len(sweeper.final())
        print(json.dumps(result))


if __name__ == "__main__":
    main()
