"""``recovery.py --scheduler ray``: the same measure on a real Ray cluster, two faults, against
the local scheduler in the same run.

The cluster is the one of the Ray plugin's tests (:class:`planaria_ray.testing.LocalCluster`:
a head and three worker raylets on this machine, each in a network namespace of its own, a
host of its own), started here and shut down at the end (root only). The job
(examples/train_gpt.py, 2 nodes x ``--procs-per-node`` over gloo) runs under
``scheduler.backend: ray`` on 2 of the 3 worker raylets, the third is the spare, and under the
local scheduler (2 nodes on this machine) as the baseline.

- worker kill: ``PLANARIA_CHAOS`` kills rank 1 at ``--kill-at``, under both.
- node loss: once rank 0 logged step ``--kill-at``, the raylet of node-1's Ray node is
  SIGKILLed (its actor, agent and workers die with it; the master replaces the node on the
  spare). Under the local scheduler node-1's agent and its workers are SIGKILLed (found
  through /proc by the trial's marker and ``PLANARIA_NODE_ID``), what a dying node does to them.
  The cluster gets a new raylet after each node loss, so every trial has its spare.
- ``ray standby+replica`` (node loss only): the same on Ray with ``job.standby: 1`` (an actor
  on 3 of the 4 worker raylets: one stands by, warm, and takes the lost node's place; the
  fourth raylet, started just before the run, takes the replacement) and
  ``checkpoint.replica`` (the node of rank 0 keeps a copy of the lost node's newest saved
  step, which the node taking its place fetches: its ranks restore from memory, 0 steps
  redone).

MTTR: from the fault to the first step rank 0 logs after it resumed (as recovery_slurm.py);
steps redone: the steps rank 0 had done by then that it did again.
Every run has a marker of its own (:mod:`planaria.leftovers`); the cluster's daemons carry
none, the actors carry the run's (the scheduler passes it on). After each run whatever
carries it is killed and named, and the end checks all of them (``left_behind``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

if not __package__:  # loaded by its path, not as benchmarks.NAME: import through the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (
    KILL,
    TrialResult,
    chaos,
    fault_table,
    interleave,
    interrupted,
    kill_local_node,
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
from planaria_ray.testing import AGENT, LocalCluster


def run(
    args: argparse.Namespace,
    work: Path,
    cluster: LocalCluster | None,
    node_loss: bool,
    standby: int = 0,
    replica: bool = False,
) -> TrialResult:
    """One ``planaria run``: on the Ray cluster, or (``cluster`` None) the local scheduler; with
    ``standby`` nodes standing by and, with ``replica``, peer replicas of the steps saved."""
    config: dict[str, object] = {
        "job": {
            "name": "bench",
            "command": [sys.executable, *train_args(args, work / "ckpt")],
            "nodes": 2,
            "procs_per_node": args.procs_per_node,
            "max_restarts": 3,
            "standby": standby,
        },
        "diagnosis": {"checks": []},
        "master": {"heartbeat_interval": "1s", "heartbeat_timeout": "15s"},
        "checkpoint": {"replica": {}} if replica else {},
    }
    if cluster is not None:
        options = {"address": cluster.address, "resources": AGENT, "stop_grace": "1s"}
        config["scheduler"] = {"backend": "ray", "options": options}
        # The nodes are hosts of their own: the master listens beyond loopback.
        config["master"] = {"heartbeat_interval": "1s", "heartbeat_timeout": "15s",
                            "host": "0.0.0.0"}  # fmt: skip
    if not node_loss:
        config["chaos"] = json.loads(chaos(args))
    (work / "job.yaml").write_text(json.dumps(config))

    added: list[str] = []
    if cluster is not None and node_loss and standby:
        # Every worker raylet will hold an actor: the replacement needs a fresh one. It joins
        # before the run, not at the loss: starting a raylet takes seconds of this machine's
        # CPU, and the job could end before the loss struck.
        added.append(cluster.add_node())

    def lose_node() -> float | None:
        if last_step(rank0_log(work)) < args.kill_at:
            return None
        lost = node_of_rank(work, 1)  # not always node-1: a node standing by is in no round
        if lost is None:
            return None
        if cluster is None:
            struck = time.time()
            return struck if kill_local_node(lost) else None
        (run_dir,) = work.glob("planaria-runs/*")
        victim = cluster.ray_node_of(run_dir, lost)
        struck = time.time()
        cluster.kill_raylet(victim)
        return struck

    planaria = str(Path(sys.executable).parent / "planaria")
    started = time.time()
    try:
        ok, output, struck = launch(
            [planaria, "run", str(work / "job.yaml")], work, dict(os.environ),
            args.timeout, lose_node if node_loss else None,
        )  # fmt: skip
    finally:
        if cluster is not None and node_loss and not added:
            cluster.add_node()  # the spare for the next trial
    wall = time.time() - started
    note = note_of(ok, output)
    if not node_loss:
        killed = next(work.glob("planaria-runs/*/logs/rank-1.log"), None)
        kill = KILL.search(killed.read_text(errors="replace")) if killed else None
        struck = float(kill["t"]) if kill else None
    return measure_fault(rank0_log(work), struck, ok, wall, note)


def main(args: argparse.Namespace) -> None:
    signal.signal(signal.SIGTERM, interrupted)  # so that the cluster is shut down
    with leftovers.Sweeper() as sweeper:  # checks at the end even if the benchmark fails
        print("starting a Ray cluster of 4 nodes, each a host of its own", flush=True)
        cluster = LocalCluster(workers=3)
        try:
            trials = compare(args, cluster, sweeper)
        finally:
            cluster.shutdown()
        report(args, trials, sweeper)


def compare(
    args: argparse.Namespace, cluster: LocalCluster, sweeper: leftovers.Sweeper
) -> dict[str, list[TrialResult]]:
    """The trials, interleaved."""
    runners: dict[str, Callable[[Path], TrialResult]] = {
        "kill: ray": lambda w: run(args, w, cluster, node_loss=False),
        "kill: local": lambda w: run(args, w, None, node_loss=False),
        "node: ray": lambda w: run(args, w, cluster, node_loss=True),
        "node: local": lambda w: run(args, w, None, node_loss=True),
        "node: ray standby+replica": lambda w: run(
            args, w, cluster, node_loss=True, standby=1, replica=True
        ),
    }
    return interleave(args.trials, runners, sweeper)


def report(
    args: argparse.Namespace, trials: dict[str, list[TrialResult]], sweeper: leftovers.Sweeper
) -> None:
    figures = {name: summarise(name, found) for name, found in trials.items()}
    print()
    print("node loss, ray: SIGKILL of node-1's raylet; local: SIGKILL of node-1's agent+workers")
    result: dict[str, object] = {"scheduler": "ray", "trials": args.trials}
    result |= fault_table(figures, ("ray", "ray", "ray"), ("local", "local", "local"))
    print()
    result |= node_loss_rows(figures, ["ray standby+replica"], "ray")
    left = sweeper.final()
    result["survivors_killed"] = len(sweeper.killed)
    result["left_behind"] = len(left)
    print(json.dumps(result))
