"""``recovery.py --node-loss``: a node lost mid-training, with and without nodes standing by,
against torchrun's node loss with the node started again, in one run.

The job is examples/train_gpt.py, 2 nodes x ``--procs-per-node`` workers over gloo, a flash
checkpoint to memory every step and to storage every ``--ckpt-every``. Once rank 0 logged step
``--kill-at``, node 1 (node rank 1) dies: every process of it is SIGKILLed at once (its agent, warm
interpreter and workers, found through /proc by the trial's marker and ``PLANARIA_NODE_ID``;
under torchrun, node 1's launcher and its workers).

The node lost under planaria is the one of node rank 1 (the timeline's round says which), or
of each rank ``--kill-rank`` names; ``--store`` names where the workers' store is
(``rendezvous.store``): ``rank0``, the worker of rank 0 hosts it (the default), ``master``, a
process beside the master does; ``--standby`` how many nodes stand by (``job.standby``). One
row for each rank, store and standby count: losing rank 0's node under ``rank0`` loses the
store too, and the next round waits for a new rank 0 to host one.

- ``planaria``: the local scheduler replaces the node (a cold start: a new agent, Python and the
  torch import) and the next round waits for it.
- ``planaria standby``: the same job with ``job.standby: 1``: a third node stood by, warm, and
  takes the lost node's place as soon as the next round opens; the replacement refills the pool.
- ``planaria replica`` and ``planaria standby+replica``: the same with ``checkpoint.replica``:
  node 0 keeps a copy of node 1's newest saved step, and the node that takes node 1's rank
  fetches it, so its ranks restore from memory instead of storage (0 steps redone).
- ``torchrun``: two ``torchrun --nnodes 2`` launchers (c10d rendezvous on node 0's launcher,
  ``--max-restarts 3``); node 1's launcher and workers are SIGKILLed and a new launcher for node
  1 is started at once, as a scheduler that restarts a lost node would (the best case for it).

MTTR: from the kill to the first step rank 0 logs after it resumed; steps redone: the steps rank
0 had done by then that it did again (without a replica the lost node's ranks restore from
storage, so up to ``--ckpt-every`` - 1). The ratio column is each figure over torchrun's, in the
same run. Trials are interleaved; every trial's processes carry a marker of their own and are
swept after it (``left_behind`` in the JSON).

    python benchmarks/recovery.py --node-loss [--trials 3] [--steps 60] [--kill-at 30]
        [--kill-rank 0 1] [--store rank0 master] [--standby 0 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.harness import (
    HANG,
    TrialResult,
    interleave,
    kill_local_node,
    last_step,
    launch,
    measure_fault,
    node_of_rank,
    note_of,
    rank0_log,
    ratio,
    summarise,
    train_args,
)
from planaria import leftovers
from planaria.checkpoint.persister import SOCKET_DIR_KIND
from planaria.shm import SHM_DIR, name_prefix, remove_dir
from planaria.testing.processes import kill_marked

NODE = "BENCH_TORCHRUN_NODE"
"""Marks the processes of each torchrun launcher by its node (0 or 1)."""


def rows(
    kill_ranks: list[int], stores: list[str], standby: list[int] | None = None
) -> list[tuple[str, int, str, int]]:
    """The planaria rows: (name, node rank lost, ``rendezvous.store``, ``job.standby``) for
    each of them; rank 1 under ``rank0`` is the row named ``planaria`` (``planaria standby``
    with nodes standing by), the others name their rank and store."""
    found = []
    for spare in dict.fromkeys(standby or [0]):
        for rank in dict.fromkeys(kill_ranks):
            for store in dict.fromkeys(stores):
                name = "planaria standby" if spare else "planaria"
                if (rank, store) != (1, "rank0"):
                    name += f" r{rank} {store}"
                found.append((name, rank, store, spare))
    return found


def run_planaria(
    args: argparse.Namespace,
    work: Path,
    standby: int,
    kill_rank: int = 1,
    store: str = "rank0",
    replica: bool = False,
) -> TrialResult:
    config = {
        "job": {
            "name": "bench",
            "command": [sys.executable, *train_args(args, work / "ckpt")],
            "nodes": 2,
            "procs_per_node": args.procs_per_node,
            "max_restarts": 3,
            "standby": standby,
        },
        "rendezvous": {"store": store},
        "diagnosis": {"checks": []},
        "master": {"heartbeat_interval": "1s", "heartbeat_timeout": "15s"},
        "checkpoint": {"replica": {}} if replica else {},
    }
    (work / "job.yaml").write_text(json.dumps(config))

    def lose_node() -> float | None:
        if last_step(rank0_log(work)) < args.kill_at:
            return None
        # Not always node-1: a node that stands by is in none.
        victim = node_of_rank(work, kill_rank)
        struck = time.time()
        return struck if victim is not None and kill_local_node(victim) else None

    planaria = str(Path(sys.executable).parent / "planaria")
    started = time.time()
    ok, output, struck = launch(
        [planaria, "run", str(work / "job.yaml")], work, dict(os.environ), args.timeout, lose_node
    )
    return measure_fault(rank0_log(work), struck, ok, time.time() - started, note_of(ok, output))


def _planaria(
    args: argparse.Namespace, rank: int, store: str, standby: int, replica: bool = False
) -> Callable[[Path], TrialResult]:
    return lambda w: run_planaria(
        args, w, standby=standby, kill_rank=rank, store=store, replica=replica
    )


def run_torchrun(args: argparse.Namespace, work: Path) -> TrialResult:
    with socket.socket() as probe:  # a free port for the rendezvous (taken again at once)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    command = [
        torchrun,
        "--nnodes", "2", "--nproc-per-node", str(args.procs_per_node), "--max-restarts", "3",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
        *train_args(args, work / "ckpt"),
    ]  # fmt: skip
    # The workaround recovery.py measures: restarted workers must not reach a dead store.
    base = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    base.pop("PLANARIA_PROGRESS_FILE", None)

    def start(node: int, name: str) -> subprocess.Popen[bytes]:
        with (work / name).open("w") as out:
            return subprocess.Popen(
                command, cwd=work, env={**base, NODE: str(node)}, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    before = _standalone_dirs()
    node0 = start(0, "node-0.log")
    time.sleep(0.5)  # node 0's launcher hosts the rendezvous store: it binds first
    nodes = [node0, start(1, "node-1.log")]
    struck: float | None = None
    started = time.time()
    deadline = time.monotonic() + args.timeout
    try:
        while node0.poll() is None and time.monotonic() < deadline:
            if struck is None and last_step(_rank0(work)) >= args.kill_at:
                marker = os.environ.get(leftovers.VARIABLE, "")
                struck = time.time()
                kill_marked({f"{leftovers.VARIABLE}={marker}".encode(), f"{NODE}=1".encode()})
                nodes.append(start(1, "node-1-again.log"))
            time.sleep(0.02)
    finally:
        for proc in nodes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # What node 1's killed workers had in /dev/shm (their persister died with them: on a
        # real cluster that memory went with the node). The survivors removed their own.
        for path in _standalone_dirs() - before:
            remove_dir(path)
    ok = node0.returncode == 0
    output = _rank0(work) + ("" if time.monotonic() < deadline else HANG)
    return measure_fault(_rank0(work), struck, ok, time.time() - started, note_of(ok, output))


def _standalone_dirs() -> set[Path]:
    """The private /dev/shm directories of trainers that run outside planaria."""
    return set(SHM_DIR.glob(f"{name_prefix()}{SOCKET_DIR_KIND}*"))


def _rank0(work: Path) -> str:
    """What torchrun's node 0 (rank 0 among its workers) printed so far."""
    log = work / "node-0.log"
    return log.read_text(errors="replace") if log.exists() else ""


def main(args: argparse.Namespace) -> None:
    with leftovers.Sweeper() as sweeper:  # checks at the end even if the benchmark fails
        runners: dict[str, Callable[[Path], TrialResult]] = {
            name: _planaria(args, rank, store, spare)
            for name, rank, store, spare in rows(args.kill_rank, args.store, args.standby)
        }
        runners.setdefault("planaria standby", _planaria(args, 1, "rank0", 1))
        runners["planaria replica"] = _planaria(args, 1, "rank0", 0, replica=True)
        runners["planaria standby+replica"] = _planaria(args, 1, "rank0", 1, replica=True)
        runners["torchrun"] = lambda w: run_torchrun(args, w)
        trials = interleave(args.trials, runners, sweeper)
        figures = {name: summarise(name, found) for name, found in trials.items()}
        print()
        print(
            "node loss: SIGKILL of every process of node 1 (rows '... rR STORE': of node rank "
            "R, rendezvous.store STORE), torchrun's node 1 started again"
        )
        base = figures["torchrun"]["mttr"]
        result: dict[str, object] = {"fault": "node_loss", "trials": args.trials}
        for name, found in figures.items():
            key = name.replace(" ", "_")
            shown = ratio(found["mttr"], base)
            mttr = "failed" if found["mttr"] is None else f"{found['mttr']:.2f}s"
            times = "-" if shown is None else f"{shown:.2f}"
            print(
                f"{name:<30} MTTR {mttr:>7}  steps redone {found['steps_lost']}  x torchrun {times}"
            )
            result |= {
                f"{key}_mttr_s": found["mttr"],
                f"{key}_steps_redone": found["steps_lost"],
                f"{key}_failed": found["failed"],
                f"{key}_x_torchrun": shown,
            }
        left = sweeper.final()
        result["survivors_killed"] = len(sweeper.killed)
        result["left_behind"] = len(left)
        print(json.dumps(result))
