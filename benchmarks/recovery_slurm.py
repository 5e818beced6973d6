"""``recovery.py --scheduler slurm``: the same measure on a real Slurm cluster, two faults.

The cluster is the one-machine one of the Slurm plugin's tests (``cluster.sh start 4``; left
alone when one is already running in ``PLANARIA_SLURM_DIR``, stopped at the end otherwise).
Each run gets an allocation of its own (3 nodes, ``--no-kill --oversubscribe``) that is
cancelled after it, so a hung baseline leaves no step behind.

- ``planaria run`` with ``scheduler.backend: slurm`` uses 2 of the 3 nodes, the third is the
  spare. Worker kill: ``PLANARIA_CHAOS`` kills rank 1 at ``--kill-at``. Node loss: once rank 0
  logged step ``--kill-at``, ``scancel J.S`` of the agent step of the node of node rank 1 (the
  node without rank 0).
- ``planaria standby+replica`` (node loss only): the same with ``job.standby: 1`` (4 nodes
  allocated: one stands by, warm, and takes the lost node's place) and ``checkpoint.replica``
  (the node of rank 0 keeps a copy of the lost node's newest saved step, which the node taking
  its place fetches over the network: its ranks restore from memory, 0 steps redone, where the
  others redo up to ``--ckpt-every`` - 1 from storage).
- baseline: ``srun --jobid J -N2 --ntasks-per-node=1 --overlap torchrun --nnodes=2 ...``, one
  step holding both torchrun agents, the way Slurm users run it. Worker kill: the same chaos
  rule. Node loss: one task of a step cannot be cancelled on its own, so the second node's
  torchrun agent and its workers are SIGKILLed (found through /proc), which is what a node that
  dies does to them.

MTTR: from the fault to the first step rank 0 logs after it resumed; steps redone: the steps
rank 0 had done by then that it did again.

Every run has a marker of its own (:mod:`planaria.leftovers`), as in recovery.py: srun passes
the environment into the steps (``--export=ALL``, also given explicitly for the baseline, so
that a site's ``SLURM_EXPORT_ENV`` cannot drop it), so the agents, torchrun and the workers that
slurmstepd starts carry it; the cluster's daemons are started without any. After each run
whatever carries it is killed and named, and the end checks all of them (``left_behind``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

if not __package__:  # loaded by its path, not as benchmarks.NAME: import through the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (
    KILL,
    ROOT,
    TrialResult,
    chaos,
    fault_table,
    interleave,
    interrupted,
    last_step,
    launch,
    measure_fault,
    node_loss_rows,
    node_of_rank,
    note_of,
    rank0_log,
    summarise,
    train_args,
)
from planaria import leftovers
from planaria.testing.processes import environ_of

CLUSTER = ROOT / "plugins" / "slurm" / "tests" / "cluster.sh"
NODES = 4
SBATCH_NODES = 3  # 2 for the job, 1 spare
TORCHRUN_NODE_LOSS = "SIGKILL of node 2's torchrun agent and its workers (not scancel)"


def slurm(*args: str, check: bool = True) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and proc.returncode:
        raise RuntimeError(f"{' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def _alive(pidfile: Path) -> bool:
    try:
        pid = int(pidfile.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True


@contextlib.contextmanager
def cluster() -> Iterator[None]:
    """A running cluster with its client environment in os.environ; stopped at the end only
    when it was started here."""
    where = Path(os.environ.get("PLANARIA_SLURM_DIR", "/tmp/planaria-slurm"))
    mine = not _alive(where / "run" / "slurmctld.pid")
    if mine and (shutil.which("slurmctld") is None or shutil.which("srun") is None):
        subprocess.run([str(CLUSTER), "install"], check=True)
    try:
        if mine:
            print(f"starting a {NODES}-node Slurm cluster in {where}", flush=True)
        command = [str(CLUSTER), "start", str(NODES)] if mine else [str(CLUSTER), "env"]
        out = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=120,
            env=leftovers.unmarked(os.environ),  # the daemons outlive every run
        )
        if out.returncode:
            raise RuntimeError(f"cluster.sh {command[1]} failed:\n{out.stderr}")
        for line in out.stdout.splitlines():
            if line.startswith("export "):
                name, _, value = line[len("export ") :].partition("=")
                os.environ[name] = value
        yield
    finally:
        if mine:
            subprocess.run(
                [str(CLUSTER), "stop"],
                capture_output=True,
                text=True,
                timeout=120,
                env=leftovers.unmarked(os.environ),
            )


def job_state(job_id: str) -> str:
    return slurm("squeue", "-h", "-j", job_id, "-o", "%T", check=False).strip()


@contextlib.contextmanager
def allocation(work: Path, nodes: int = SBATCH_NODES) -> Iterator[str]:
    job_id = slurm(
        "sbatch", "--parsable", f"-N{nodes}", "--oversubscribe", "--no-kill",
        f"--chdir={work}", "--output=/dev/null", "--job-name=planaria-bench",
        "--wrap", "exec sleep infinity",
    ).strip()  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while job_state(job_id) != "RUNNING":
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm job {job_id} did not start within 60 s")
            time.sleep(0.2)
        yield job_id
    finally:
        slurm("scancel", job_id, check=False)
        deadline = time.monotonic() + 60
        while job_state(job_id) and time.monotonic() < deadline:
            time.sleep(0.2)


def run_planaria(
    args: argparse.Namespace, work: Path, node_loss: bool, standby: int = 0, replica: bool = False
) -> TrialResult:
    """One ``planaria run`` in an allocation of its own: with ``standby`` nodes standing by
    (each one more node allocated) and, with ``replica``, peer replicas of the steps saved."""
    with allocation(work, SBATCH_NODES + standby) as job_id:
        config: dict[str, object] = {
            "job": {
                "name": "bench",
                "command": [sys.executable, *train_args(args, work / "ckpt")],
                "nodes": 2,
                "procs_per_node": args.procs_per_node,
                "max_restarts": 3,
                "standby": standby,
            },
            "scheduler": {"backend": "slurm", "options": {"job_id": job_id}},
            "diagnosis": {"checks": []},
            "checkpoint": {"replica": {}} if replica else {},
        }
        if not node_loss:
            config["chaos"] = json.loads(chaos(args))
        (work / "job.yaml").write_text(json.dumps(config))

        def cancel_node() -> float | None:
            if last_step(rank0_log(work)) < args.kill_at:
                return None
            lost = node_of_rank(work, 1)  # not always node-1: a node standing by is in no round
            out = slurm("squeue", "-h", "-s", "-j", job_id, "-o", "%i|%j|%N", check=False)
            steps = [line.split("|") for line in out.splitlines() if line.count("|") == 2]
            victim = next((s for s, name, _ in steps if name.endswith(f".{lost}")), None)
            if lost is None or victim is None:
                return None
            struck = time.time()
            slurm("scancel", victim)
            return struck

        planaria = str(Path(sys.executable).parent / "planaria")
        started = time.time()
        ok, output, struck = launch(
            [planaria, "run", str(work / "job.yaml")], work, dict(os.environ),
            args.timeout, cancel_node if node_loss else None,
        )  # fmt: skip
        wall = time.time() - started
    note = note_of(ok, output)
    if not node_loss:
        killed = next(work.glob("planaria-runs/*/logs/rank-1.log"), None)
        kill = KILL.search(killed.read_text(errors="replace")) if killed else None
        struck = float(kill["t"]) if kill else None
    return measure_fault(rank0_log(work), struck, ok, wall, note)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _first_node_addr(job_id: str) -> str:
    listed = slurm("squeue", "-h", "-j", job_id, "-o", "%N").strip()
    nodes = slurm("scontrol", "show", "hostnames", listed)
    shown = slurm("scontrol", "show", "node", nodes.split()[0])
    found = re.search(r"NodeAddr=(\S+)", shown)
    return found[1] if found else nodes.split()[0]


def kill_torchrun_node(job_id: str, node_id: int, held: set[Path]) -> bool:
    """SIGKILL the torchrun agent that Slurm runs as node ``node_id``'s task of the job, and
        its workers. Every node of this cluster is this machine, so /proc holds them all; the shared
    memory they held goes into ``held``."""
    marks = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_NODEID={node_id}".encode()}
    table = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,args="], capture_output=True, text=True)
    children: dict[str, list[str]] = {}
    agents = []
    for line in table.stdout.splitlines():
        pid, ppid, cmd = [*line.split(None, 2), ""][:3]
        children.setdefault(ppid, []).append(pid)
        if "torchrun" in cmd and not cmd.startswith("srun") and marks <= set(environ_of(pid)):
            agents.append(pid)
    agents = [a for a in agents if not any(a in children.get(b, []) for b in agents)]
    doomed, todo = [], list(agents)
    while todo:
        pid = todo.pop()
        doomed.append(pid)
        todo += children.get(pid, [])
    for pid in doomed:
        held.update(_shm_of(pid))
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    return bool(agents)


def _shm_of(pid: str) -> set[Path]:
    """The /dev/shm/planaria-* directories a process maps or holds open: a node that dies takes
    them with it, a process killed here leaves them, so the benchmark removes them."""
    found: set[Path] = set()
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            found |= {Path(w) for w in line.split() if w.startswith("/dev/shm/planaria-")}
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                found.add(Path(os.readlink(fd)))
    return {
        Path("/dev/shm", p.relative_to("/dev/shm").parts[0])
        for p in found
        if str(p).startswith("/dev/shm/planaria-")
    }


def run_torchrun(
    args: argparse.Namespace, work: Path, workaround: bool, node_loss: bool
) -> TrialResult:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PLANARIA_PROGRESS_FILE", None)
    if not node_loss:
        env["PLANARIA_CHAOS"] = chaos(args)
    if workaround:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    with allocation(work) as job_id:
        endpoint = f"{_first_node_addr(job_id)}:{_free_port()}"
        command = [
            "srun", f"--jobid={job_id}", "-N2", "--ntasks-per-node=1", "--overlap", "--export=ALL",
            str(Path(sys.executable).parent / "torchrun"),
            "--nnodes=2", f"--nproc-per-node={args.procs_per_node}", "--max-restarts", "3",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", f"bench-{job_id}",
            *train_args(args, work / "ckpt"),
        ]  # fmt: skip
        log = work / "launcher.log"
        held: set[Path] = set()

        def kill_node() -> float | None:
            text = log.read_text(errors="replace") if log.exists() else ""
            if last_step(text) < args.kill_at:
                return None
            struck = time.time()
            return struck if kill_torchrun_node(job_id, 1, held) else None

        started = time.time()
        ok, output, struck = launch(
            command, work, env, args.timeout, kill_node if node_loss else None
        )
        wall = time.time() - started
    for path in held:
        shutil.rmtree(path, ignore_errors=True)
    note = note_of(ok, output)
    if not node_loss:
        kill = KILL.search(output)
        struck = float(kill["t"]) if kill else None
    return measure_fault(output, struck, ok, wall, note)


def main(args: argparse.Namespace) -> None:
    runners: dict[str, Callable[[Path], TrialResult]] = {
        "kill: planaria run": lambda w: run_planaria(args, w, node_loss=False),
        "kill: torchrun (defaults)": lambda w: run_torchrun(args, w, False, node_loss=False),
        "kill: torchrun (workaround)": lambda w: run_torchrun(args, w, True, node_loss=False),
        "node: planaria run": lambda w: run_planaria(args, w, node_loss=True),
        "node: torchrun (workaround)": lambda w: run_torchrun(args, w, True, node_loss=True),
        "node: planaria standby+replica": lambda w: run_planaria(
            args, w, node_loss=True, standby=1, replica=True
        ),
    }
    signal.signal(signal.SIGTERM, interrupted)  # so that the cluster is stopped all the same
    with leftovers.Sweeper() as sweeper:  # checks at the end even if the benchmark fails
        compare(args, runners, sweeper)


def compare(
    args: argparse.Namespace,
    runners: dict[str, Callable[[Path], TrialResult]],
    sweeper: leftovers.Sweeper,
) -> None:
    """The trials on the cluster and the report."""
    with cluster():
        trials = interleave(args.trials, runners, sweeper)
    print()
    figures = {name: summarise(name, found) for name, found in trials.items()}
    print(f"node loss, torchrun: {TORCHRUN_NODE_LOSS}; planaria: scancel of the node's step")
    print()
    result: dict[str, object] = {"scheduler": "slurm", "trials": args.trials}
    result |= fault_table(
        figures,
        ("planaria run", "planaria", "planaria run"),
        ("torchrun", "torchrun", "torchrun (workaround)"),
    )
    print()
    result |= node_loss_rows(figures, ["planaria standby+replica"], "planaria run")
    result["worker_kill_torchrun_default_mttr_s"] = figures["kill: torchrun (defaults)"]["mttr"]
    result["worker_kill_torchrun_default_failed"] = figures["kill: torchrun (defaults)"]["failed"]
    result["node_loss_torchrun_fault"] = TORCHRUN_NODE_LOSS
    left = sweeper.final()
    result["survivors_killed"] = len(sweeper.killed)
    result["left_behind"] = len(left)
    print(json.dumps(result))
