"""The fault suite: one short deterministic training job through each fault planaria must survive.

The job is examples/train_gpt.py (DDP over gloo) on 2 nodes x 1 worker of the local scheduler,
40 steps, a flash checkpoint in memory every step and persisted every 5. It runs once without a
fault (the reference: its final weights), then once per fault, and each row says:

- survived: the job ended succeeded, the fault really happened (its event is in the
  timeline) and planaria did what it should about it (the row's note says what that is);
- bitwise equal: the final weights are bitwise those of the reference (the data of a step
  depends only on the step and the rank, so a resumed job must end where the clean one did);
- steps lost, recovery time: from the master's ``recovered`` events (steps done before the
  fault that were done again; from the fault to the first step after it); for a fault that
  stops no training the row says what it measures instead.

Faults come from chaos rules (``planaria run``'s fault injection) where one fits, otherwise
from this script while the job runs (``driver`` functions in :mod:`benchmarks.faults_trial`).

Run:  python benchmarks/faults.py [--only NAME[,NAME]] [--list] [--timeout S]
Root is needed for the disk-full row (it mounts a small tmpfs) and the partition row (network
namespaces). The last line printed is one JSON object: ``{"faults": [{"fault", "survived",
"bitwise_equal", "steps_lost", "recovery_s"}, ...], "all_passed": bool}``. Exit code 0 iff
every row that ran passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if not __package__:  # run as ``python benchmarks/faults.py``: import through the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.faults_trial import Event, Outcome, Trial, open_files

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_gpt.py"
STEPS = 40
PERSIST_EVERY = 5
FAULT_AT = 20
"""The step at which a fault strikes (or after which one is looked for)."""


@dataclass
class Row:
    fault: str
    survived: bool
    bitwise_equal: bool
    steps_lost: int
    recovery_s: float
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.survived and self.bitwise_equal

    def as_json(self) -> dict[str, Any]:
        return {
            "fault": self.fault,
            "survived": self.survived,
            "bitwise_equal": self.bitwise_equal,
            "steps_lost": self.steps_lost,
            "recovery_s": self.recovery_s,
        }


class ReferenceFailed(Exception):
    """The fault-free run failed: no row can be judged."""


def unavailable(fault: str, missing: str) -> Row:
    """A row whose machinery is not here: it fails, saying what is missing."""
    return Row(fault, False, False, 0, 0.0, f"not available: {missing}")


class Suite:
    """Where the trials run, how a job is configured, and the reference weights."""

    def __init__(self, root: Path, timeout: float) -> None:
        self.root = root
        self.timeout = timeout
        self.planaria = [sys.executable, "-m", "planaria"]
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("PLANARIA_")},
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "COLUMNS": "200",
        }
        self.reference: dict[str, Any] | None = None
        self.reference_error = ""
        self.persist_bytes = 0
        """The size of one persisted step (every rank), from the reference run."""

    def workdir(self, name: str) -> Path:
        work = self.root / name
        work.mkdir()
        return work

    def trial(self, work: Path, prefix: Sequence[str] = (), **sections: Any) -> Trial:
        """``prefix``: what ``planaria run`` runs through (``ip netns exec NS``)."""
        command = [sys.executable, str(EXAMPLE), "--steps", str(STEPS)]
        command += ["--ckpt-every", str(PERSIST_EVERY), "--out", str(work / "final.pt")]
        config: dict[str, Any] = {
            "job": {
                "name": "faults",
                "command": command,
                "nodes": 2,
                "procs_per_node": 1,
                "max_restarts": 3,
            },
            "rendezvous": {"join_grace": "1s", "join_timeout": "60s"},
            # A roomy heartbeat timeout: on a loaded machine the warm interpreter of a node can take
            # over 10 s to import torch, and the agent sends no heartbeat while it waits for it.
            "master": {"heartbeat_interval": "1s", "heartbeat_timeout": "30s"},
            "diagnosis": {"checks": []},
            "checkpoint": {
                "storage": {"backend": "local", "options": {"path": str(work / "store")}},
                "keep_last": 3,
            },
        }
        for name, value in sections.items():
            merged = {**config.get(name, {}), **value} if isinstance(value, dict) else value
            config[name] = merged
        path = work / "job.yaml"
        path.write_text(json.dumps(config, indent=1))  # JSON is YAML
        argv = [*prefix, *self.planaria, "run", str(path)]
        return Trial(work, argv, self.env, self.timeout)

    def run(
        self,
        name: str,
        driver: Callable[[Trial], str] | None = None,
        work: Path | None = None,
        prefix: Sequence[str] = (),
        **sections: Any,
    ) -> Outcome:
        if name != "reference":
            self.ready()
        print(f"  running {name} ...", file=sys.stderr, flush=True)
        return self.trial(work or self.workdir(name), prefix, **sections).run(driver)

    def ready(self) -> None:
        """Run the fault-free reference once, before the first trial that needs it."""
        if self.reference is None and not self.reference_error:
            self.reference_error = reference(self) or ""
        if self.reference_error:
            raise ReferenceFailed(self.reference_error)

    def bitwise(self, outcome: Outcome) -> bool:
        import torch

        final = outcome.work / "final.pt"
        if self.reference is None or not final.exists():
            return False
        weights = torch.load(final, weights_only=True, map_location="cpu")
        ref = self.reference
        return weights.keys() == ref.keys() and all(torch.equal(weights[k], ref[k]) for k in ref)

    def row(
        self,
        fault: str,
        outcome: Outcome,
        evidence: list[tuple[object, str]],
        note: str,
        figures: tuple[int, float] | None = None,
    ) -> Row:
        """``evidence``: (found, what is missing if not) pairs, each of which must hold for the
        fault to count as survived; ``note`` says what happened when they all do."""
        missing = [why for found, why in evidence if not found]
        survived = outcome.succeeded and not missing
        equal = self.bitwise(outcome)
        lost, seconds = figures if figures is not None else outcome.recovery()
        if not outcome.succeeded:
            note = outcome.failure
        elif missing:
            note = f"{missing[0]} ({outcome.driver_error or outcome.driver_note or 'no note'})"
        elif not equal:
            note = f"final weights differ from the fault-free run's; {note}"
        if outcome.left_behind:
            note += f"; left behind: {', '.join(outcome.left_behind)}"
        return Row(fault, survived, equal, lost, seconds, note)


# -- reading a timeline ------------------------------------------------------------------------


def faults(outcome: Outcome, fault: str) -> list[Event]:
    return [e for e in outcome.of("fault_detected") if e["data"]["fault"] == fault]


def restored(outcome: Outcome) -> str:
    """Where the last restart restored from: ``memory step 20``, ``storage step 19``."""
    lines = [
        line.split()
        for line in outcome.log("rank-0.log").splitlines()
        if line.startswith("resumed from step ")
    ]
    if not lines:
        return "no restore"
    words = lines[-1]  # resumed from step N (where)
    return f"{words[-1].strip('()')} step {words[3]}"


def _started(outcome: Outcome) -> float:
    return float(outcome.of("job_started")[0]["time"]) if outcome.of("job_started") else 0.0


# -- the faults ------------------------------------------------------------------------------


def worker_sigkill(suite: Suite) -> Row:
    outcome = suite.run(
        "worker-sigkill", chaos=[{"kind": "kill_worker", "rank": 1, "at_step": FAULT_AT}]
    )
    killed = [e for e in faults(outcome, "worker_failed") if e["data"].get("signal") == 9]
    return suite.row(
        "worker-sigkill",
        outcome,
        [(killed, "no worker died of SIGKILL"), (outcome.of("recovered"), "no recovery")],
        f"rank 1 SIGKILLed at step {FAULT_AT}: workers restarted in place from {restored(outcome)}",
    )


def worker_exception(suite: Suite) -> Row:
    outcome = suite.run(
        "worker-exception", chaos=[{"kind": "raise_in_worker", "rank": 1, "at_step": FAULT_AT}]
    )
    raised = "InjectedFault" in outcome.log("rank-1.log")
    return suite.row(
        "worker-exception",
        outcome,
        [
            (raised, "rank 1 raised no exception"),
            (faults(outcome, "worker_failed"), "no worker failure detected"),
            (outcome.of("recovered"), "no recovery"),
        ],
        f"rank 1 raised at step {FAULT_AT} (classified "
        f"{_first_class(outcome)}): restarted in place from {restored(outcome)}",
    )


def _first_class(outcome: Outcome) -> str:
    found = [e for e in faults(outcome, "worker_failed") if not e["data"].get("secondary")]
    return str(found[0]["data"].get("fault_class", "-")) if found else "-"


def worker_hang(suite: Suite) -> Row:
    outcome = suite.run(
        "worker-hang",
        chaos=[{"kind": "stop_worker", "rank": 1, "at_step": FAULT_AT}],
        diagnosis={"hang_timeout": "3s"},
    )
    hangs = [e for e in outcome.of("hang_detected") if not e["data"]["secondary"]]
    recovered = outcome.of("recovered")
    stopped = chaos_time(outcome.log("rank-1.log"))
    lost, seconds = outcome.recovery()
    if hangs and recovered and stopped is not None:
        # The master times a hang from its detection; here it runs from the SIGSTOP itself.
        first_step = hangs[0]["time"] + recovered[0]["data"]["recovery_s"]
        seconds = round(first_step - stopped, 2)
    return suite.row(
        "worker-hang",
        outcome,
        [(hangs, "no hang detected"), (recovered, "no recovery")],
        f"rank 1 SIGSTOPped at step {FAULT_AT}: hang detected after the 3 s hang_timeout, "
        f"stacks dumped, workers restarted from {restored(outcome)} (recovery: from the "
        "SIGSTOP, detection included)",
        figures=(lost, seconds),
    )


def chaos_time(log: str) -> float | None:
    """When a worker-side chaos rule fired: the ``time=`` of its line in the rank's log."""
    for line in log.splitlines():
        if line.startswith("planaria chaos: ") and " time=" in line:
            return float(line.rsplit(" time=", 1)[1])
    return None


def agent_sigkill(suite: Suite) -> Row:
    outcome = suite.run(
        "agent-sigkill", chaos=[{"kind": "kill_node", "node_rank": 1, "at_step": FAULT_AT}]
    )
    replaced = outcome.of("node_replaced")
    new = replaced[0]["data"]["replacement"] if replaced else "-"
    return suite.row(
        "agent-sigkill",
        outcome,
        [
            (faults(outcome, "node_lost"), "no node loss detected"),
            (replaced, "the lost node was not replaced"),
            (outcome.of("recovered"), "no recovery"),
        ],
        f"node rank 1's agent SIGKILLed at step {FAULT_AT} (its worker died with it): "
        f"replaced by {new}, restored from {restored(outcome)}",
    )


def agent_sigkill_standby(suite: Suite) -> Row:
    outcome = suite.run(
        "agent-sigkill-standby",
        job={"standby": 1},  # merged into the suite's job section
        chaos=[{"kind": "kill_node", "node_rank": 1, "at_step": FAULT_AT}],
    )
    rounds = outcome.of("rendezvous_completed")
    promoted = [r for r in rounds if r["data"].get("from_standby")]
    taken = promoted[0]["data"]["from_standby"] if promoted else []
    replaced = outcome.of("node_replaced")
    refill = replaced[0]["data"]["replacement"] if replaced else "-"
    return suite.row(
        "agent-sigkill-standby",
        outcome,
        [
            (faults(outcome, "node_lost"), "no node loss detected"),
            (promoted, "no node standing by took the lost node's place"),
            (all(refill not in r["data"]["ranks"] for r in rounds), "the refill joined a round"),
            (outcome.of("recovered"), "no recovery"),
        ],
        f"as agent-sigkill, with job.standby 1: {', '.join(taken) or '-'} stood by and took "
        f"node rank 1 at once, {refill} refilled the pool; restored from {restored(outcome)}",
    )


def agent_sigkill_replica(suite: Suite) -> Row:
    outcome = suite.run(
        "agent-sigkill-replica",
        job={"standby": 1},
        checkpoint={"replica": {}},
        chaos=[{"kind": "kill_node", "node_rank": 1, "at_step": FAULT_AT}],
    )
    rounds = outcome.of("rendezvous_completed")
    last = rounds[-1]["data"] if rounds else {}
    from_replica = str(last.get("restore", "")).startswith("memory:") and str(
        last.get("restore_why", "")
    ).endswith(": replicas)")
    return suite.row(
        "agent-sigkill-replica",
        outcome,
        [
            (faults(outcome, "node_lost"), "no node loss detected"),
            (last.get("from_standby"), "no node standing by took the lost node's place"),
            (from_replica, f"not restored from the replica: {last.get('restore_why', '-')}"),
            (outcome.of("recovered"), "no recovery"),
        ],
        "as agent-sigkill-standby, with checkpoint.replica: the lost node's ranks fetched from "
        f"the survivor's replica; restored from {restored(outcome)}",
    )


def resume_available(suite: Suite) -> bool:
    """Whether ``planaria run`` here can re-adopt a job (``--resume RUN_DIR``)."""
    help_ = subprocess.run(
        [*suite.planaria, "run", "--help"],
        env={**suite.env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return "--resume" in help_.stdout


def master_sigkill(suite: Suite) -> Row:
    if not resume_available(suite):
        return unavailable(
            "master-sigkill", "planaria run --resume RUN_DIR (a journalled master) is missing"
        )
    killed_at: list[float] = []

    def drive(trial: Trial) -> str:
        trial.wait_for(f"step {FAULT_AT}", lambda: True if trial.step() >= FAULT_AT else None)
        assert trial.run_dir is not None
        killed_at.append(time.time())
        trial.relaunch([*suite.planaria, "run", "--resume", str(trial.run_dir)])
        return f"master SIGKILLed at step {trial.step()}, resumed with --resume"

    outcome = suite.run("master-sigkill", drive)
    after = [e for e in outcome.events if killed_at and e["time"] > killed_at[0]]
    back = round(after[0]["time"] - killed_at[0], 2) if after else 0.0
    restarts = outcome.of("workers_restarted")
    return suite.row(
        "master-sigkill",
        outcome,
        [(killed_at, "the master was not killed"), (not restarts, "workers were restarted")],
        f"the master SIGKILLed at step {FAULT_AT}, resumed on its run directory: the job "
        f"went on without a worker restart (recovery: to the resumed master's first event)",
        figures=(outcome.recovery()[0], back),
    )


def persister_sigkill(suite: Suite) -> Row:
    work = suite.workdir("persister-sigkill")
    store = os.path.realpath(work / "store")
    killed: list[tuple[float, str]] = []

    def drive(trial: Trial) -> str:
        node = trial.node_of_rank(0)  # its persister also commits every step
        trial.event("a first commit", lambda e: e["kind"] == "checkpoint_committed")
        victim = trial.persister(node)

        def writing() -> str | None:
            paths = [p for p in open_files(victim.pid) if p.startswith(store)]
            return next((p for p in paths if ".partial/" in p), None)

        path = trial.wait_for("the persister wrote a step", writing, interval=0.001)
        os.kill(victim.pid, signal.SIGKILL)
        killed.append((time.time(), node))
        return f"SIGKILLed {node}'s persister while it wrote {os.path.relpath(path, store)}"

    outcome = suite.run("persister-sigkill", drive, work)
    restarts = [
        e for e in outcome.of("persister_restarted") if killed and e["node"] == killed[0][1]
    ]
    back = round(restarts[0]["time"] - killed[0][0], 2) if restarts else 0.0
    return suite.row(
        "persister-sigkill",
        outcome,
        [(killed, "the persister was not killed"), (restarts, "no persister_restarted")],
        f"{outcome.driver_note}: the agent started a new one, the last step was committed, "
        "training never stopped (recovery: to the new persister)",
        figures=(0, back),
    )


def disk_full(suite: Suite) -> Row:
    suite.ready()  # its size, below
    work = suite.workdir("disk-full")
    store = work / "store"
    store.mkdir()
    # Room for two persisted steps and part of a third: the third fails part-way.
    size = max(1, int(suite.persist_bytes * 2.3) // 4096) * 4096
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(store)],
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        return unavailable("disk-full", f"cannot mount a tmpfs (root?): {mount.stderr.strip()}")
    try:
        outcome = suite.run("disk-full", work=work, checkpoint={"allow_unpersisted_end": True})
        intact, problems = verify_committed(store)
    finally:
        subprocess.run(["umount", "-l", str(store)], capture_output=True, check=False)
    full = [e for e in outcome.of("checkpoint_failed") if "No space left" in e["data"]["error"]]
    failed = sorted({e["step"] for e in full})
    restarts = outcome.of("workers_restarted")
    return suite.row(
        "disk-full",
        outcome,
        [
            (full, "no persist failed with 'No space left on device'"),
            (not restarts, "workers were restarted for a full disk"),
            (intact and not problems, f"committed steps do not verify: {problems}"),
        ],
        f"storage a {size >> 10} KiB tmpfs: persists of steps {_steps(failed)} failed (No "
        f"space left), steps {_steps(sorted(intact))} committed before stayed intact; survived "
        "= trained to the end with no restart, ended succeeded (allow_unpersisted_end)",
    )


def _steps(steps: list[int]) -> str:
    return ",".join(map(str, steps)) or "none"


def verify_committed(store: Path) -> tuple[list[int], list[str]]:
    """The committed steps in ``store`` whose every file verifies, and what is wrong with the
    others."""
    from planaria.checkpoint.persisted import PersistedCheckpoints
    from planaria.errors import PlanariaError

    checkpoints = PersistedCheckpoints.open({"backend": "local", "options": {"path": str(store)}})
    good, problems = [], []
    for step in checkpoints.committed_steps():
        try:
            manifest = checkpoints.manifest(step)
            for rank in range(manifest.world):
                checkpoints.shard(step, rank, manifest)
        except PlanariaError as exc:
            problems.append(str(exc))
        else:
            good.append(step)
    return good, problems


def _restore_past(suite: Suite, fault: str, damage: Callable[[Path], str]) -> Row:
    """Damage the newest committed step once training passed it, and lose a node at once: its
    replacement (with no memory) makes every rank restore from storage, where the damaged step
    must be skipped for the one before it."""
    work = suite.workdir(fault)
    damaged: list[int] = []

    def drive(trial: Trial) -> str:
        node = trial.node_of_rank(1)
        commit = trial.event(
            f"step {FAULT_AT - 1} committed",
            lambda e: e["kind"] == "checkpoint_committed" and e["step"] >= FAULT_AT - 1,
        )
        os.kill(trial.agent(node).pid, signal.SIGKILL)
        what = damage(work / "store" / f"step-{commit['step']}")
        damaged.append(commit["step"])
        return f"step {commit['step']} committed: {what}, {node}'s agent SIGKILLed"

    outcome = suite.run(fault, drive, work)
    skipped = [e for e in outcome.of("checkpoint_skipped") if damaged and e["step"] == damaged[0]]
    return suite.row(
        fault,
        outcome,
        [
            (damaged, "nothing was damaged"),
            (skipped, "the damaged step was not skipped"),
            (outcome.of("node_replaced"), "the lost node was not replaced"),
            (outcome.of("recovered"), "no recovery"),
        ],
        f"{outcome.driver_note}: the restore skipped it (checkpoint_skipped) and used "
        f"{restored(outcome)}",
    )


def corrupt_shard(suite: Suite) -> Row:
    def flip(step: Path) -> str:
        shard = step / "rank-1.bin"
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        shard.write_bytes(bytes(raw))
        return "a byte of rank-1.bin flipped"

    return _restore_past(suite, "corrupt-shard", flip)


def truncated_manifest(suite: Suite) -> Row:
    def truncate(step: Path) -> str:
        manifest = step / "manifest.json"
        size = manifest.stat().st_size
        os.truncate(manifest, size // 2)
        return f"manifest.json truncated to {size // 2} of {size} bytes"

    return _restore_past(suite, "truncated-manifest", truncate)


def slow_node(suite: Suite) -> Row:
    outcome = suite.run(
        "slow-node",
        chaos=[{"kind": "slow_worker", "rank": 1, "factor": 3, "at_step": FAULT_AT}],
        diagnosis={"straggler_window": 5},
    )
    slow = [e for e in outcome.of("straggler_detected") if e.get("rank") == 1]
    seen = (
        f"flagged a straggler ({slow[0]['data']['ratio']:.1f}x the others' "
        f"{slow[0]['data']['metric']} time)"
        if slow
        else ""
    )
    return suite.row(
        "slow-node",
        outcome,
        [(slow, "rank 1 was not flagged as a straggler")],
        f"rank 1 computes 3x slower from step {FAULT_AT}: {seen}, reported, not replaced "
        "(replace_stragglers: false); training never stopped",
        figures=(0, 0.0),
    )


CHECK_SCRIPT = """#!/bin/sh
# A chip check that fails on host local-1 (custom_script's JSON protocol on stdout).
if [ "$PLANARIA_NODE" = local-1 ]; then
  echo '{"device": "chip0", "status": "failed", "detail": "12 uncorrectable ECC errors"}'
  exit 1
fi
echo '{"device": "chip0", "status": "ok"}'
"""


def health_check(suite: Suite) -> Row:
    if importlib.util.find_spec("planaria_custom_script") is None:
        return unavailable("health-check", "pip install planaria-custom-script")
    work = suite.workdir("health-check")
    script = work / "check.sh"
    script.write_text(CHECK_SCRIPT)
    script.chmod(0o755)
    check = {"backend": "custom_script", "name": "chip", "options": {"path": str(script)}}
    outcome = suite.run(
        "health-check",
        work=work,
        scheduler={"backend": "local", "options": {"hosts": 3}},
        diagnosis={"checks": [check]},
    )
    unhealthy = [e for e in outcome.of("health_checked") if not e["data"]["healthy"]]
    excluded = [e for e in outcome.of("node_excluded") if e["data"]["host"] == "local-1"]
    rounds = outcome.of("rendezvous_completed")
    clean = bool(unhealthy and rounds) and unhealthy[0]["node"] not in rounds[0]["data"]["ranks"]
    delay = round(rounds[0]["time"] - unhealthy[0]["time"], 2) if unhealthy and rounds else 0.0
    return suite.row(
        "health-check",
        outcome,
        [
            (unhealthy, "no node failed its health check"),
            (excluded, "host local-1 was not excluded"),
            (clean, "the unhealthy node joined the first round"),
        ],
        "the chip check fails on host local-1: the node is excluded and replaced before the "
        "first round, which trains without it (recovery: from the failed check to the round)",
        figures=(0, delay),
    )


PARTITION_HEARTBEAT = ("0.5s", "5s")
"""The partition row's heartbeat interval and timeout: short, so that a cut outlasts the
timeout soon; its nodes start workers without a warm interpreter (``job.preload: []``), whose
start would keep an agent silent for longer than that on a loaded machine."""
SPARES = ("n0", "n1", "n2")
"""The nodes' namespaces: node-i runs in ``SPARES[i % 3]``, so the replacement (node-2) runs in
a namespace of its own."""


def partition(suite: Suite) -> Row:
    if os.geteuid() != 0:  # before any import: an unprivileged user may not even read them
        return Row("partition", False, False, 0, 0.0, "needs root (network namespaces)")
    from planaria.testing.netns import Network
    from planaria.testing.netns import unavailable as netns_unavailable

    why = netns_unavailable()
    if why is not None:
        return unavailable("partition", why)
    suite.ready()
    seen: dict[str, Any] = {}

    with Network(["master", *SPARES]) as net:

        def drive(trial: Trial) -> str:
            trial.wait_for(f"step {FAULT_AT}", lambda: True if trial.step() >= FAULT_AT else None)
            node = trial.node_of_rank(1)
            member = _namespace(node)
            old = net.pids(member)
            net.cut(member)  # silent: every frame to or from it vanishes
            cut_at = time.time()
            seen["node"] = node
            trial.event(f"{node} declared lost", lambda e: _lost(e, node))
            new = trial.event(
                f"{node} replaced", lambda e: e["kind"] == "node_replaced" and e["node"] == node
            )["data"]["replacement"]
            # Heal once the replacement holds the cut-off node's rank in a new round: two
            # copies of the rank now exist, and the old one must be the one that stops. (Not
            # later: the job may end before the old node's first packet after the heal, which
            # waits out its TCP backoff, gets through.)
            trial.event(
                f"a round with {new}",
                lambda e: e["kind"] == "rendezvous_completed" and new in e["data"]["ranks"],
            )
            seen["replacement_ran"] = bool(net.pids(_namespace(new)))
            seen["old_survived_cut"] = bool(old) and set(old) <= set(net.pids(member))
            net.heal(member)
            healed_at = time.time()
            seen["cut_s"] = round(healed_at - cut_at, 1)
            trial.wait_for(
                f"{node}'s processes to end once healed",
                lambda: True if not set(old) & set(net.pids(member)) else None,
            )
            seen["stopped_s"] = round(time.time() - healed_at, 1)
            return f"{node} cut off at step {FAULT_AT} for {seen['cut_s']} s"

        outcome = suite.run(
            "partition",
            drive,
            prefix=net.exec("master", []),
            job={"preload": []},
            scheduler={
                "backend": "local",
                # keep_replaced: like a cluster's scheduler, this one cannot stop a cut-off node.
                "options": {"netns": [net.netns(n) for n in SPARES], "keep_replaced": True},
            },
            master={
                "host": net.address("master"),
                "heartbeat_interval": PARTITION_HEARTBEAT[0],
                "heartbeat_timeout": PARTITION_HEARTBEAT[1],
            },
        )
        stray = net.close()
    if stray:
        outcome.left_behind.append(f"pids {stray} in the namespaces")
    node = seen.get("node", "-")
    replaced = [e for e in outcome.of("node_replaced") if e["node"] == node]
    new = replaced[0]["data"]["replacement"] if replaced else "-"
    fenced = [e for e in outcome.of("node_fenced") if e["node"] == node]
    return suite.row(
        "partition",
        outcome,
        [
            ([e for e in outcome.events if _lost(e, node)], "the cut-off node was not lost"),
            (replaced, "the lost node was not replaced"),
            (seen.get("replacement_ran"), "no replacement ran in the spare namespace"),
            (seen.get("old_survived_cut"), "the cut-off node did not live through the cut"),
            (restored(outcome).startswith("storage"), "the new round did not restore from storage"),
            (fenced, "the healed node was not fenced (node_fenced)"),
            ("stopped_s" in seen, "the fenced node's processes did not end while the job ran"),
            (not outcome.of("node_replacement_failed"), "a node replacement failed"),
            (outcome.of("recovered"), "no recovery"),
        ],
        f"{outcome.driver_note} (silent drop; heartbeat timeout {PARTITION_HEARTBEAT[1]}): "
        f"lost, replaced by {new} in the spare namespace, restored from {restored(outcome)}; "
        f"once healed it was fenced and its processes were gone after "
        f"{seen.get('stopped_s', '-')} s",
    )


def _namespace(node: str) -> str:
    """The participant of the network that ``node`` (``node-i``) runs in."""
    return SPARES[int(node.rsplit("-", 1)[1]) % len(SPARES)]


def _lost(event: Event, node: str) -> bool:
    kind, where, data = event["kind"], event["node"], event["data"]
    return bool(kind == "fault_detected" and where == node and data.get("fault") == "node_lost")


FAULTS: dict[str, tuple[Callable[[Suite], Row], str]] = {
    "worker-sigkill": (worker_sigkill, "SIGKILL a worker (chaos kill_worker)"),
    "worker-exception": (worker_exception, "an exception in a worker (chaos raise_in_worker)"),
    "worker-hang": (worker_hang, "a worker SIGSTOPped (chaos stop_worker)"),
    "agent-sigkill": (agent_sigkill, "SIGKILL a node's agent: node loss (chaos kill_node)"),
    "agent-sigkill-standby": (
        agent_sigkill_standby,
        "the same node loss with a node standing by (job.standby 1)",
    ),
    "agent-sigkill-replica": (
        agent_sigkill_replica,
        "the same with a peer replica: the lost ranks restore from memory (checkpoint.replica)",
    ),
    "master-sigkill": (master_sigkill, "SIGKILL the master, then planaria run --resume"),
    "persister-sigkill": (persister_sigkill, "SIGKILL a persister while it writes a shard"),
    "disk-full": (disk_full, "checkpoint storage on a tmpfs too small for the checkpoints"),
    "corrupt-shard": (corrupt_shard, "a committed shard's byte flipped, then a node lost"),
    "truncated-manifest": (truncated_manifest, "a committed manifest cut, then a node lost"),
    "slow-node": (slow_node, "a worker 3x slower (chaos slow_worker): a straggler"),
    "health-check": (health_check, "a custom_script health check failing on one node"),
    "partition": (partition, "a network partition of one node (network namespaces)"),
}


# -- the run ---------------------------------------------------------------------------------


def reference(suite: Suite) -> str:
    """Run the job without a fault; keep its weights. An error message, or empty."""
    import torch

    outcome = suite.run("reference")
    final = suite.root / "reference" / "final.pt"
    if not outcome.succeeded or not final.exists():
        return f"the fault-free run failed: {outcome.failure}"
    suite.reference = torch.load(final, weights_only=True, map_location="cpu")
    sizes = [e["data"].get("bytes") or 0 for e in outcome.of("checkpoint_committed")]
    suite.persist_bytes = max(sizes, default=0)
    took = outcome.events[-1]["time"] - _started(outcome)
    print(f"  reference: {STEPS} steps in {took:.1f}s", file=sys.stderr, flush=True)
    return ""


WIDTH = max(len(name) for name in FAULTS)
"""The fault column: as wide as the longest name."""
HEADER = f"{'fault':<{WIDTH}} {'survived':<9} {'bitwise':<8} {'lost':>5} {'recovery':>9}  note"


def line(row: Row) -> str:
    yes = {True: "yes", False: "NO"}
    return (
        f"{row.fault:<{WIDTH}} {yes[row.survived]:<9} {yes[row.bitwise_equal]:<8} "
        f"{row.steps_lost:>5} {row.recovery_s:>8.2f}s  {row.note}"
    )


def selected(only: str | None) -> list[str]:
    if not only:
        return list(FAULTS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown or not names:
        raise SystemExit(
            f"--only: unknown fault(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(FAULTS)}"
        )
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", metavar="NAME[,NAME]", help="run only these faults")
    parser.add_argument("--list", action="store_true", help="list the faults and exit")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per trial")
    parser.add_argument("--keep", action="store_true", help="keep the trials' directories")
    args = parser.parse_args()
    if args.list:
        for name, (_, what) in FAULTS.items():
            print(f"{name:<20} {what}")
        return
    names = selected(args.only)

    root = Path(tempfile.mkdtemp(prefix="planaria-faults-"))
    suite = Suite(root, args.timeout)
    rows: list[Row] = []
    started = time.monotonic()
    print(HEADER, flush=True)
    try:
        for name in names:
            try:
                row = FAULTS[name][0](suite)
            except ReferenceFailed as exc:
                row = Row(name, False, False, 0, 0.0, str(exc))
            rows.append(row)
            print(line(row), flush=True)
    finally:
        if args.keep:
            print(f"  trials kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    passed = all(row.passed for row in rows)
    print(f"  {len(rows)} fault(s) in {time.monotonic() - started:.0f}s", file=sys.stderr)
    print(json.dumps({"faults": [row.as_json() for row in rows], "all_passed": passed}))
    raise SystemExit(0 if passed else 1)


if __name__ == "__main__":
    main()
