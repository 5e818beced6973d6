"""Effective training time of a 16,384-GPU job through a year's worth of its faults: planaria
against a torchrun-style whole-job restart from periodic checkpoints.

The fault rates are those of Llama 3 405B pre-training (Meta's report, "The Llama 3 Herd of
Models", 2024): 466 job interruptions in a 54-day snapshot, 47 planned (maintenance) and 419
unexpected, about 78% of these attributed to hardware, the rest to software and other causes.
Meta reports more than 90% effective training time; planaria's goal is 98% or more.

Faults arrive as a Poisson process per kind. One trace (fixed seed) is replayed against both
systems; each keeps the training it did up to its last checkpoint that the fault leaves usable,
and pays its downtime. A fault during a recovery restarts the recovery. Effective training time
is the training kept divided by the wall time (job start included).

What each system does, per kind of fault:

- hardware (a GPU or host fails): planaria detects a dead host after the heartbeat timeout,
  replaces the node (a hot spare) and every rank restores from the last persisted step;
  torchrun-style, the whole job is restarted and restores from its last checkpoint.
- software crash: planaria restarts the workers in place, restoring from shared memory;
  torchrun-style, a whole-job restart.
- hang: planaria detects it after ``diagnosis.hang_timeout``, then restarts in place from
  memory; torchrun-style, NCCL's watchdog ends the job after its timeout, then a restart.
- planned: both save on purpose (nothing lost) and restart the job.

planaria's costs are the figures this repository measures (``--measured`` takes the JSON line of
benchmarks/faults.py, recovery.py or checkpoint.py; otherwise the documented figures); the
costs that only exist at scale are assumptions, each printed with its source.

Run:  python benchmarks/goodput_sim.py [--days 54] [--trials 20] [--seed 0] [--measured FILE]
The last line printed is one JSON object:
``{"gpus": 16384, "planaria_effective": f, "torchrun_effective": f, ...}`` (fractions 0..1).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DAY = 86400.0
GPUS = 16384

# -- the fault rates (Llama 3 405B, Meta's report) ------------------------------------------------
REPORT = "Llama 3 report (Meta, 2024): 54 days"
SNAPSHOT_DAYS = 54
UNEXPECTED, PLANNED, HARDWARE_SHARE = 419, 47, 0.78


@dataclass
class Figure:
    value: float
    source: str


def documented() -> dict[str, Figure]:
    """planaria's measured costs as docs/reliability.md and the benchmarks record them, and the
    assumptions about the cluster."""
    faults = "docs/reliability.md, fault suite 2026-12-02"
    ckpt = "benchmarks/checkpoint.py --size-mib 512 --runs 3, 2026-12-03 (docs/reliability.md)"
    return {
        # measured on 2 nodes of one machine (benchmarks/faults.py)
        "crash_restart_s": Figure(0.72, f"worker-exception recovery, {faults}"),
        "hang_restart_s": Figure(4.58 - 3.0, f"worker-hang recovery less its 3 s wait, {faults}"),
        "node_replace_s": Figure(4.93, f"agent-sigkill recovery (node replaced), {faults}"),
        "save_bytes_per_s": Figure(536_580_344 / 0.04047, f"Checkpointer.save median, {ckpt}"),
        # planaria's defaults (core/planaria/config/models.py)
        "heartbeat_timeout_s": Figure(15.0, "master.heartbeat_timeout default"),
        "hang_timeout_s": Figure(300.0, "diagnosis.hang_timeout default"),
        "persist_every_s": Figure(120.0, "assumption: persist every 2 min (background writes)"),
        # the job and the cluster
        "params": Figure(405e9, "Llama 3 405B"),
        "state_bytes_per_param": Figure(14.0, "bf16 weights + fp32 master + 2 fp32 Adam moments"),
        "step_s": Figure(
            6 * 405e9 * 16e6 / (GPUS * 989e12 * 0.40),
            "6 x 405e9 x 16M tokens a step / (16,384 x 989 TFLOPS bf16 x 40% MFU): the report's "
            "batch and MFU (38-43%)",
        ),
        "storage_bytes_per_s": Figure(2e12, "Llama 3 report: storage sustains 2 TB/s"),
        "job_restart_s": Figure(
            600.0,
            "assumption: requeue, 2,048 nodes allocated, processes and NCCL started, checkpoint "
            "read; no per-restart figure is published for this run",
        ),
        "nccl_timeout_s": Figure(600.0, "torch.distributed's default NCCL timeout (10 min)"),
        "comm_init_s": Figure(
            30.0,
            "assumption: NCCL communicators re-made at 16,384 ranks on an in-place restart (not "
            "measured: planaria's restarts are measured on one machine)",
        ),
    }


def read_measured(paths: Sequence[Path], figures: dict[str, Figure]) -> None:
    """Take planaria's figures from benchmark JSON lines (the last line of each file)."""
    for path in paths:
        lines = [ln for ln in path.read_text().splitlines() if ln.strip().startswith("{")]
        if not lines:
            raise SystemExit(f"{path}: no JSON line (expected a benchmark's output)")
        data = json.loads(lines[-1])
        found = False
        rows = {row["fault"]: row for row in data.get("faults", []) if row.get("survived")}
        for key, row, less in (
            ("crash_restart_s", "worker-exception", 0.0),
            ("node_replace_s", "agent-sigkill", 0.0),
            ("hang_restart_s", "worker-hang", 3.0),
        ):
            if row in rows:
                value = max(float(rows[row]["recovery_s"]) - less, 0.0)
                figures[key] = Figure(value, f"{row} recovery in {path}")
                found = True
        if data.get("planaria_mttr_s") is not None:
            figures["crash_restart_s"] = Figure(data["planaria_mttr_s"], f"MTTR in {path}")
            found = True
        medians = data.get("medians_s") or {}
        if medians.get("save") and data.get("bytes"):
            rate = data["bytes"] / medians["save"]
            figures["save_bytes_per_s"] = Figure(rate, f"Checkpointer.save median in {path}")
            found = True
        if not found:
            raise SystemExit(f"{path}: none of planaria's figures found in its JSON line")


# -- the model ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Response:
    """What a system does about one kind of fault: its downtime, and where it restores from
    (``memory``, ``storage``, or ``saved``: a checkpoint written on purpose, nothing lost)."""

    downtime_s: float
    restore: str


@dataclass
class System:
    name: str
    responses: dict[str, Response]
    levels: dict[str, tuple[float, float]]
    """restore source -> (training seconds between saves, seconds training blocks per save)."""
    start_s: float
    notes: list[str] = field(default_factory=list)


def rates(days: float) -> dict[str, float]:
    """Faults per second of each kind, from the report's counts."""
    software = UNEXPECTED * (1 - HARDWARE_SHARE)
    counts = {
        "hardware": UNEXPECTED * HARDWARE_SHARE,
        "software crash": software * 0.9,
        "hang": software * 0.1,
        "planned": PLANNED,
    }
    return {kind: n / (SNAPSHOT_DAYS * DAY) for kind, n in counts.items()}


def daly(write_s: float, mtbf_s: float, restart_s: float) -> float:
    """Daly's first-order optimum checkpoint interval (training seconds between writes)."""
    return max(math.sqrt(2 * write_s * (mtbf_s + restart_s)) - write_s, write_s)


def systems(f: dict[str, float], rate: dict[str, float]) -> tuple[System, System]:
    state = f["params"] * f["state_bytes_per_param"]
    write = state / f["storage_bytes_per_s"]  # the whole job's state, to storage
    save = state / GPUS / f["save_bytes_per_s"]  # one rank's share, to its shared memory
    step, restart = f["step_s"], f["job_restart_s"]
    total = sum(rate.values())

    mtbf_memory = 1 / (rate["software crash"] + rate["hang"])
    memory_every = step * max(1, round(daly(save, mtbf_memory, f["crash_restart_s"]) / step))
    persist = max(f["persist_every_s"], write)
    in_place = f["comm_init_s"]
    planaria = System(
        "planaria",
        {
            "hardware": Response(
                f["heartbeat_timeout_s"] + f["node_replace_s"] + write + in_place, "storage"
            ),
            "software crash": Response(f["crash_restart_s"] + in_place, "memory"),
            "hang": Response(f["hang_timeout_s"] + f["hang_restart_s"] + in_place, "memory"),
            "planned": Response(write + restart, "saved"),
        },
        {"memory": (memory_every, save), "storage": (persist, 0.0)},
        restart,
        [
            f"saves to memory every {memory_every / step:.0f} step(s) ({memory_every:.0f} s, "
            f"Daly), blocking {save * 1e3:.0f} ms ({state / GPUS / 1e6:.0f} MB a rank)",
            f"persists every {persist:.0f} s in the background (a write takes {write:.1f} s)",
        ],
    )
    every = daly(write, 1 / total, restart)
    torchrun = System(
        "torchrun-style",
        {
            "hardware": Response(restart, "storage"),
            "software crash": Response(restart, "storage"),
            "hang": Response(f["nccl_timeout_s"] + restart, "storage"),
            "planned": Response(write + restart, "saved"),
        },
        {"storage": (every, write)},
        restart,
        [f"checkpoints every {every:.0f} s (Daly), blocking {write:.1f} s a write"],
    )
    return planaria, torchrun


def trace(rate: dict[str, float], horizon: float, rng: random.Random) -> list[tuple[float, str]]:
    faults = []
    for kind, per_s in rate.items():
        t = rng.expovariate(per_s)
        while t < horizon:
            faults.append((t, kind))
            t += rng.expovariate(per_s)
    return sorted(faults)


def kept(system: System, source: str, wall: float) -> tuple[float, float]:
    """(training kept, training lost) after ``wall`` seconds of training since the last resume,
    ended by a fault that restores from ``source``. Training blocks for every save of every
    level; what was trained after the newest save of ``source`` is lost."""
    overhead = sum(cost / every for every, cost in system.levels.values())
    trained = wall / (1 + overhead)
    if source == "saved":
        return trained, 0.0
    every, _ = system.levels[source]
    done = math.floor(trained / every) * every
    return done, trained - done


@dataclass
class Tally:
    kept: float = 0.0
    lost: dict[str, float] = field(default_factory=dict)
    down: dict[str, float] = field(default_factory=dict)
    blocked: float = 0.0


def replay(system: System, faults: list[tuple[float, str]], horizon: float) -> Tally:
    tally = Tally(down={"job start": min(system.start_s, horizon)})
    overhead = sum(cost / every for every, cost in system.levels.values())
    resume, recovering = system.start_s, "job start"
    for t, kind in faults:
        if t >= horizon:
            break
        response = system.responses[kind]
        if t > resume:
            done, lost = kept(system, response.restore, t - resume)
            tally.kept += done
            tally.lost[kind] = tally.lost.get(kind, 0.0) + lost
            tally.blocked += (t - resume) - (done + lost)
        else:  # a fault during a recovery: that recovery is cut short, this one starts
            tally.down[recovering] -= resume - t
        resume, recovering = t + response.downtime_s, kind
        tally.down[kind] = tally.down.get(kind, 0.0) + response.downtime_s
    if resume < horizon:
        trained = (horizon - resume) / (1 + overhead)
        tally.kept += trained
        tally.blocked += (horizon - resume) - trained
    else:
        tally.down[recovering] -= resume - horizon
    return tally


# -- the report -----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--days", type=float, default=SNAPSHOT_DAYS, help="horizon of a trial")
    parser.add_argument("--trials", type=int, default=20, help="Monte-Carlo trials")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--measured", type=Path, action="append", default=[], metavar="FILE")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a figure, e.g. --set crash_restart_s=2 (names: the table's)",
    )
    args = parser.parse_args()
    if args.days <= 0 or args.trials < 1:
        raise SystemExit("--days must be positive and --trials at least 1")
    figures = documented()
    read_measured(args.measured, figures)
    for item in args.set:
        name, _, text = item.partition("=")
        if name not in figures:
            raise SystemExit(f"--set {item}: no figure {name!r}; known: {', '.join(figures)}")
        try:
            figures[name] = Figure(float(text), "--set on the command line")
        except ValueError:
            raise SystemExit(f"--set {item}: {text!r} is not a number") from None

    print(f"{'figure':<22} {'value':>12}  source")
    for name, fig in figures.items():
        print(f"{name:<22} {fig.value:>12.4g}  {fig.source}")
    rate = rates(args.days)
    print(f"\nfault rates ({REPORT}; software crash/hang split 90/10 is an assumption):")
    for kind, per_s in rate.items():
        print(f"  {kind:<15} {per_s * DAY:6.2f} a day ({per_s * args.days * DAY:6.1f} a trial)")

    result = simulate({k: v.value for k, v in figures.items()}, rate, args)
    print(json.dumps(result))


SENSITIVITY = [
    ("comm_init_s", 0.0),
    ("comm_init_s", 120.0),
    ("job_restart_s", 300.0),
    ("job_restart_s", 1200.0),
    ("persist_every_s", 600.0),
    ("hang_timeout_s", 600.0),
]
"""Assumptions varied one at a time, after the main result."""


def trials(
    values: dict[str, float], rate: dict[str, float], args: argparse.Namespace
) -> tuple[tuple[System, System], dict[str, list[Tally]]]:
    """Every trial's tally per system; trial n replays the same trace for both."""
    horizon = args.days * DAY
    pair = systems(values, rate)
    tallies: dict[str, list[Tally]] = {s.name: [] for s in pair}
    for n in range(args.trials):
        faults = trace(rate, horizon, random.Random(args.seed * 1_000_003 + n))
        for system in pair:
            tally = replay(system, faults, horizon)
            accounted = tally.kept + tally.blocked + sum(tally.lost.values())
            accounted += sum(tally.down.values())
            assert abs(accounted - horizon) < 1e-6 * horizon, (system.name, accounted, horizon)
            tallies[system.name].append(tally)
    return pair, tallies


def simulate(
    values: dict[str, float], rate: dict[str, float], args: argparse.Namespace
) -> dict[str, Any]:
    horizon = args.days * DAY
    pair, tallies = trials(values, rate, args)
    effective = {name: [t.kept / horizon for t in ts] for name, ts in tallies.items()}
    for system in pair:
        print(f"\n{system.name}: " + "; ".join(system.notes))
        print(f"  {'kind':<15} {'downtime a fault':>17} {'restores from':>14}")
        for kind, r in system.responses.items():
            print(f"  {kind:<15} {r.downtime_s:>16.1f}s {r.restore:>14}")
    print(f"\ncost breakdown, hours per trial (mean of {args.trials}, {args.days:g} days each)")
    print(f"  {'':<30} {'planaria':>10} {'torchrun-style':>15}")
    rows = [("job start", "down", "job start")]
    rows += [(f"{k}: downtime", "down", k) for k in rate]
    rows += [(f"{k}: training lost", "lost", k) for k in rate if k != "planned"]
    for label, what, kind in rows:
        cells = [
            statistics.fmean(getattr(t, what).get(kind, 0.0) for t in tallies[s.name]) / 3600
            for s in pair
        ]
        print(f"  {label:<30} {cells[0]:>10.1f} {cells[1]:>15.1f}")
    blocked = [statistics.fmean(t.blocked for t in tallies[s.name]) / 3600 for s in pair]
    print(f"  {'saves blocking training':<30} {blocked[0]:>10.1f} {blocked[1]:>15.1f}")
    print("\neffective training time (training kept / wall time)")
    out: dict[str, Any] = {"gpus": GPUS}
    for system in pair:
        values_ = effective[system.name]
        mean = statistics.fmean(values_)
        spread = statistics.stdev(values_) if len(values_) > 1 else 0.0
        print(
            f"  {system.name:<15} {mean:.2%}  (sd {spread:.2%}, min {min(values_):.2%}, "
            f"max {max(values_):.2%}, {args.trials} trials)"
        )
        key = "planaria" if system.name == "planaria" else "torchrun"
        out[f"{key}_effective"] = round(mean, 5)
        out[f"{key}_sd"] = round(spread, 5)
    print("\nsensitivity (one assumption changed; mean effective time, planaria / torchrun-style)")
    for name, value in SENSITIVITY:
        changed = {**values, name: value}
        _, varied = trials(changed, rate, args)
        means = [statistics.fmean(t.kept / horizon for t in varied[s.name]) for s in pair]
        print(f"  {f'{name} = {value:g}':<26} {means[0]:.2%} / {means[1]:.2%}")
    out.update(days=args.days, trials=args.trials, seed=args.seed)
    return out


if __name__ == "__main__":
    main()
