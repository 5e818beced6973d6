"""What the benchmarks share: running a trial of a launcher, reading its figures, killing what
it leaves, printing a figure next to its baseline, and the checkpoint benchmarks' state.

A benchmark imports from here (and from its own helper modules), never from another benchmark:
the recovery benchmark's variants (Slurm, Ray, a GPU) and the checkpoint benchmark's device
variant are started by their script but depend only on this module, so no benchmark is loaded
twice (once as ``__main__``, once as a module) and the imports form no circle
(tests/unit/test_import_graph.py checks it).

The processes of a trial are found, killed and run in a session of their own by
:mod:`planaria.testing.processes`, the tests' job harness's own; torch is imported by the
functions that need it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planaria.testing.processes import kill_marked, run_group

if TYPE_CHECKING:
    import torch

    from planaria import leftovers

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_gpt.py"
KILL = re.compile(r"planaria chaos: kill_worker .* time=(?P<t>[0-9.]+)")
STEP = re.compile(r"^step (?P<step>\d+) loss \S+ time (?P<t>[0-9.]+)$")
RESUMED = re.compile(r"^resumed from step (?P<step>\d+)( \((?P<where>\w+)\))?$")
HANG = "\ntimed out (hang)"


def exit_on_sigterm() -> None:
    """A SIGTERM exits through ``sys.exit`` (status 143), so that ``finally`` blocks and context
    managers (a trial's sweep, a work directory's removal) still run."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def interrupted(signum: int, frame: object) -> None:
    """A signal handler that raises KeyboardInterrupt: the ``finally`` that stops a cluster
    runs on a SIGTERM as on a Ctrl-C."""
    raise KeyboardInterrupt


# -- a trial -------------------------------------------------------------------------------------


@dataclass
class TrialResult:
    """What one recovery trial came to: whether it recovered, how fast, what it lost."""

    ok: bool
    mttr: float | None = None
    steps_lost: int | None = None
    wall: float = 0.0
    note: str = ""


def train_args(args: argparse.Namespace, ckpt: Path) -> list[str]:
    """The training script's command line of a recovery trial (after the interpreter)."""
    return [
        str(EXAMPLE),
        "--steps", str(args.steps),
        "--ckpt-every", str(args.ckpt_every),
        "--ckpt-dir", str(ckpt),
    ]  # fmt: skip


def chaos(args: argparse.Namespace) -> str:
    """The chaos rules (``PLANARIA_CHAOS``) that kill rank 1 at ``--kill-at``."""
    return json.dumps([{"kind": "kill_worker", "rank": 1, "at_step": args.kill_at}])


def measure(rank0: str, killed: str, kill_at: int, ok: bool, wall: float, note: str) -> TrialResult:
    """A worker kill's trial from the logs: MTTR from the kill (the time the killed worker
    logged just before its SIGKILL) to rank 0's first step after it resumed; steps lost: those
    done before the kill (``kill_at``) that were done again."""
    kill = KILL.search(killed)
    if not ok or kill is None:
        return TrialResult(False, wall=wall, note=note or "no kill seen")
    kill_time = float(kill["t"])
    resumed_at: int | None = None
    for line in rank0.splitlines():
        line = line.strip()
        if (m := RESUMED.match(line)) is not None:
            resumed_at = int(m["step"])
        elif (m := STEP.match(line)) and resumed_at is not None and float(m["t"]) > kill_time:
            first = int(m["step"])
            return TrialResult(True, float(m["t"]) - kill_time, max(0, kill_at - first + 1), wall)
    return TrialResult(False, wall=wall, note="no step after the restart")


def measure_fault(
    rank0: str, struck: float | None, ok: bool, wall: float, note: str
) -> TrialResult:
    """A fault struck from outside the job at ``struck``: MTTR from then to rank 0's first step
    after it resumed; steps lost: the steps rank 0 had done by then that it did again. A run
    that did not end well (``ok`` false: it failed, or hung to its timeout) recovered from
    nothing, whatever steps it logged."""
    if struck is None:
        return TrialResult(False, wall=wall, note=note or "the fault never struck")
    if not ok:
        return TrialResult(False, wall=wall, note=note or "the run failed")
    before = [
        int(m["step"])
        for line in rank0.splitlines()
        if (m := STEP.match(line.strip())) and float(m["t"]) <= struck
    ]
    done = before[-1] if before else 0
    resumed = False
    for line in rank0.splitlines():
        line = line.strip()
        if RESUMED.match(line):
            resumed = True
        elif (m := STEP.match(line)) and resumed and float(m["t"]) > struck:
            first = int(m["step"])
            return TrialResult(True, float(m["t"]) - struck, max(0, done - first + 1), wall)
    return TrialResult(False, wall=wall, note=note or "no step after the fault")


def last_step(text: str) -> int:
    """The last step a log shows (-1: none yet)."""
    steps = [int(m["step"]) for line in text.splitlines() if (m := STEP.match(line))]
    return steps[-1] if steps else -1


def rank0_log(work: Path) -> str:
    """What rank 0 of the ``planaria run`` in ``work`` logged so far."""
    found = next(work.glob("planaria-runs/*/logs/rank-0.log"), None)
    return found.read_text(errors="replace") if found else ""


# -- running a launcher --------------------------------------------------------------------------


def run_launcher(
    command: list[str], cwd: Path, env: dict[str, str], timeout: float
) -> tuple[bool, str, str, float]:
    """A launcher (torchrun) run through :func:`run_group`: whether it succeeded, its output,
    what went wrong (its last error line, or a hang) and its wall time."""
    started = time.time()
    try:
        proc = run_group(command, cwd, env, timeout)
        ok, output = proc.returncode == 0, proc.stdout + proc.stderr
        note = "" if ok else last_error(output)
    except subprocess.TimeoutExpired as exc:
        output = text_of(exc.stdout) + text_of(exc.stderr)
        ok, note = False, "timed out (hang)"
    return ok, output, note, time.time() - started


def launch(
    command: list[str],
    work: Path,
    env: dict[str, str],
    timeout: float,
    fault: Callable[[], float | None] | None = None,
) -> tuple[bool, str, float | None]:
    """Run ``command`` in a session of its own, output to a file; ``fault`` is called every
    20 ms until it returns the time it struck. Returns (exit 0, output, fault time); a run
    killed at ``timeout`` has :data:`HANG` at the end of its output."""
    log = work / "launcher.log"
    struck: float | None = None
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if fault is not None and struck is None:
                    struck = fault()
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    timed_out = time.monotonic() >= deadline and proc.returncode != 0
    output = log.read_text(errors="replace")
    return proc.returncode == 0, output + (HANG if timed_out else ""), struck


def text_of(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def last_error(output: str) -> str:
    """The line of a failed run's output that says why: its last error, else its last line."""
    for line in reversed(output.splitlines()):
        if "Error" in line or "refused" in line:
            return line.strip()[-200:]
    return output.strip().splitlines()[-1][-200:] if output.strip() else "failed"


def note_of(ok: bool, output: str) -> str:
    """What went wrong in a run of :func:`launch` (empty when it succeeded)."""
    if ok:
        return ""
    return HANG.strip() if output.endswith(HANG) else last_error(output)


# -- faults from outside -----------------------------------------------------------------------


def kill_local_node(node_id: str) -> bool:
    """SIGKILL every process of this trial (its :mod:`planaria.leftovers` marker) that belongs to
    local node ``node_id`` (its agent, warm interpreter and workers carry
    ``PLANARIA_NODE_ID``): what a dying node does to them. Whether there was one."""
    from planaria import leftovers
    from planaria.protocol import NODE_ID_ENV

    marker = os.environ.get(leftovers.VARIABLE, "")
    wanted = {f"{leftovers.VARIABLE}={marker}".encode(), f"{NODE_ID_ENV}={node_id}".encode()}
    return kill_marked(wanted)


# -- trials and their report ---------------------------------------------------------------------


def interleave(
    count: int,
    runners: dict[str, Callable[[Path], TrialResult]],
    sweeper: leftovers.Sweeper,
    figure: str = "MTTR",
) -> dict[str, list[TrialResult]]:
    """``count`` trials of each runner, interleaved (machine drift hits all alike), each in a
    work directory of its own and swept after it; each printed as it ends, its ``mttr`` named
    ``figure`` (a runner may measure another time, a step's)."""
    trials: dict[str, list[TrialResult]] = {name: [] for name in runners}
    width = max(len(name) for name in runners) + 2
    for trial in range(count):
        for name, runner in runners.items():
            work = Path(tempfile.mkdtemp(prefix="planaria-bench-"))
            try:
                with sweeper.trial(f"trial {trial + 1}: {name}"):
                    result = runner(work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            trials[name].append(result)
            shown = f"{result.mttr:.2f}s" if result.ok and result.mttr is not None else "failed"
            note = f"  {result.note}" if not result.ok and result.note else ""
            print(
                f"trial {trial + 1}: {name:<{width}} {figure} {shown}  (wall {result.wall:.1f}s)"
                f"{note}",
                flush=True,
            )
    return trials


def summarise(name: str, trials: list[TrialResult]) -> dict[str, object]:
    """Print a runner's median MTTR, failures and steps lost, and every trial's figure; returns
    the figures (``mttr`` None when no trial succeeded)."""
    good = [t for t in trials if t.ok and t.mttr is not None]
    mttr = statistics.median(t.mttr for t in good if t.mttr is not None) if good else None
    lost = (
        statistics.median(t.steps_lost for t in good if t.steps_lost is not None) if good else None
    )
    failed = len(trials) - len(good)
    figures = ", ".join(
        f"{t.mttr:.2f}s" if t.ok and t.mttr is not None else f"FAILED ({t.note})" for t in trials
    )
    shown = "-" if mttr is None else f"{mttr:.2f}s"
    print(f"{name:<28} median MTTR {shown:>7}  failed {failed}/{len(trials)}  steps lost {lost}")
    print(f"{'':<28} trials: {figures}")
    return {"mttr": mttr, "failed": failed, "steps_lost": lost}


def ratio(mine: object, baseline: object) -> float | None:
    """``mine / baseline`` when both are figures (a non-zero baseline), else None: a runner
    that never recovered has no ratio."""
    if isinstance(mine, (int, float)) and isinstance(baseline, (int, float)) and baseline:
        return float(mine) / float(baseline)
    return None


def fault_table(
    figures: dict[str, dict[str, object]], mine: tuple[str, str, str], theirs: tuple[str, str, str]
) -> dict[str, object]:
    """Print MTTR per fault (worker kill, node loss) of two kinds of run and their ratio; returns
    the figures for the JSON. ``mine`` and ``theirs``: the column's heading, its name in the
    JSON keys, and its runners' names after ``kill: `` / ``node: ``."""

    def shown(value: object) -> str:
        return f"{value:.2f}s" if isinstance(value, float) else "failed"

    print(f"{'fault':<12} {mine[0]:>14} {theirs[0]:>14} {'ratio':>8}")
    result: dict[str, object] = {}
    for fault, key, prefix in (
        ("worker kill", "kill", "worker_kill"),
        ("node loss", "node", "node_loss"),
    ):
        a, b = figures[f"{key}: {mine[2]}"], figures[f"{key}: {theirs[2]}"]
        both = isinstance(a["mttr"], float) and isinstance(b["mttr"], float)
        found = ratio(a["mttr"], b["mttr"]) if both else None
        shown_ratio = "-" if found is None else f"{found:.2f}"
        print(f"{fault:<12} {shown(a['mttr']):>14} {shown(b['mttr']):>14} {shown_ratio:>8}")
        result |= {
            f"{prefix}_{mine[1]}_mttr_s": a["mttr"],
            f"{prefix}_{theirs[1]}_mttr_s": b["mttr"],
            f"{prefix}_ratio": found,
            f"{prefix}_steps_lost": a["steps_lost"],
            f"{prefix}_{mine[1]}_failed": a["failed"],
            f"{prefix}_{theirs[1]}_failed": b["failed"],
        }
    return result


def node_loss_rows(
    figures: dict[str, dict[str, object]], names: list[str], baseline: str
) -> dict[str, object]:
    """Print the node-loss runs beyond the table's two (standby, replica): each one's MTTR, the
    steps redone (the figure a replica brings to 0) and its MTTR over ``baseline``'s; returns
    the figures for the JSON, keyed ``node_loss_<name>_*``."""
    result: dict[str, object] = {}
    for name in names:
        found, base = figures[f"node: {name}"], figures[f"node: {baseline}"]
        mttr = found["mttr"]
        shown_ratio = ratio(mttr, base["mttr"])
        times = "-" if shown_ratio is None else f"{shown_ratio:.2f}"
        shown = f"{mttr:.2f}s" if isinstance(mttr, float) else "failed"
        print(
            f"node loss, {name:<20} MTTR {shown:>7}  steps redone {found['steps_lost']}"
            f"  x {baseline} {times}"
        )
        key = re.sub(r"\W+", "_", name)
        result |= {
            f"node_loss_{key}_mttr_s": mttr,
            f"node_loss_{key}_steps_redone": found["steps_lost"],
            f"node_loss_{key}_failed": found["failed"],
        }
    return result


def node_of_rank(work: Path, rank: int) -> str | None:
    """The node holding node rank ``rank`` in the newest round of the run in ``work`` (with
    nodes standing by, not always ``node-<rank>``)."""
    found = None
    for timeline in work.glob("planaria-runs/*/events.jsonl"):
        for line in timeline.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("kind") == "rendezvous_completed":
                    ranks = event["data"]["ranks"]
                    found = next((n for n, r in ranks.items() if r == rank), found)
    return found


# -- the checkpoint benchmarks' state ------------------------------------------------------------


def make_state(
    size_mib: float, tensors: int, seed: int, fill: bool, device: str = "cpu"
) -> dict[str, Any]:
    """A model plus an Adam-like optimizer state of ``tensors`` float32 tensors in all, about
    ``size_mib`` MiB, on ``device``. The shapes depend only on the arguments; values are random
    when ``fill`` (the same for the same seed and device), else zeros (a restarted worker's
    freshly built model: allocated and written)."""
    import torch

    if tensors < 3:
        raise SystemExit(
            f"--tensors must be at least 3 (a parameter and its two moments): {tensors}"
        )
    if size_mib <= 0:
        raise SystemExit(f"--size-mib must be positive: {size_mib}")
    rng = random.Random(seed)
    params = tensors // 3
    buffers = tensors - 3 * params
    elements = int(size_mib * (1 << 20) / 4 / 3)  # the model is a third: params + two moments
    big = min(4, params)
    weights = [40.0] * big + [
        rng.uniform(0.001, 0.01) if rng.random() < 0.5 else rng.uniform(1.0, 4.0)
        for _ in range(params - big)
    ]
    total = sum(weights)
    generator = torch.Generator(device=device).manual_seed(seed)

    def tensor(shape: tuple[int, ...]) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.float32, device=device)
        if fill:
            out.uniform_(-1.0, 1.0, generator=generator)
        else:
            out.zero_()
        return out

    def shape_of(numel: int) -> tuple[int, ...]:
        numel = max(numel, 1)
        if numel < 1 << 16:
            return (numel,)
        cols = 1024
        return (numel // cols, cols)

    model: dict[str, torch.Tensor] = {}
    shapes = [shape_of(int(elements * w / total)) for w in weights]
    for i, shape in enumerate(shapes):
        kind = "weight" if len(shape) == 2 else "bias"
        model[f"layers.{i}.{kind}"] = tensor(shape)
    for i in range(buffers):
        model[f"buffers.{i}.running_mean"] = tensor((1024,))
    optim_state = {
        i: {"step": 100.0, "exp_avg": tensor(shape), "exp_avg_sq": tensor(shape)}
        for i, shape in enumerate(shapes)
    }
    return {
        "model": model,
        "optim": {
            "state": optim_state,
            "param_groups": [
                {
                    "lr": 1e-3,
                    "betas": (0.9, 0.999),
                    "eps": 1e-8,
                    "weight_decay": 0.0,
                    "params": list(range(params)),
                }
            ],
        },
        "step": 100,
    }


def leaves(state: Any) -> list[torch.Tensor]:
    """Every tensor of ``state``, in a fixed order."""
    import torch

    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in leaves(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in leaves(v)]
    return []


def fstype(path: Path) -> str:
    """The type of the file system ``path`` is on (``/proc/mounts``; "?" when not found)."""
    best, kind = "", "?"
    resolved = str(path.resolve())
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if (
                len(fields) >= 3
                and (resolved + "/").startswith(fields[1].rstrip("/") + "/")
                and len(fields[1]) >= len(best)
            ):
                best, kind = fields[1], fields[2]
    return kind
