"""Real network partitions: the master and every node in a network namespace of its own, on
one bridge, and a participant's link cut and healed while a DDP job (examples/train_gpt.py,
gloo across the namespaces) trains.

- a cut shorter than the heartbeat timeout costs nothing: no restart, the same weights;
- a longer one loses the node, a replacement (in a spare namespace) takes its place and the job
  completes; once healed, the old node hears from the master that it is out, and stops;
- a cut of the master itself, longer than the heartbeat timeout but within ``master.grace``,
  costs nothing either once it heals: both sides wait for ``master.grace``.

Each job is small (2 nodes x 1 worker, a tiny model) and every process it starts carries a
mark: after each test none may be left, in the namespaces or anywhere. Needs root (see
tests/support/netns.py); skipped without.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from planaria.process import proc_stat
from planaria.testing.netns import Network, unavailable

torch = pytest.importorskip("torch")
from planaria.testing.jobs import EXAMPLE, MARK, marked_processes, wait_gone  # noqa: E402

# Each job: ~20 s on 2 idle CPU cores (torch starts in 2-3 processes), the long cut ~30 s.
pytestmark = pytest.mark.slow

STEPS = 40
CUT_AT = 5
HEARTBEAT_INTERVAL = 0.5
HEARTBEAT_TIMEOUT = 3.0
SHORT_CUT = 1.0
"""Well inside the timeout: TCP's retransmission backoff (0.2, 0.4, 0.8 s ...) adds up to
about as long again before the first packet after the heal gets through."""
PARTICIPANTS = ("master", "n0", "n1", "n2")
"""n0 and n1 for the job's two nodes, n2 for a replacement."""

COMMAND = [
    sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--ckpt-every", "10",
    "--vocab", "64", "--d-model", "32", "--heads", "2", "--layers", "1", "--seq", "16",
    "--batch", "4", "--out", "final.pt",
]  # fmt: skip


@pytest.fixture
def mark() -> Iterator[str]:
    value = uuid.uuid4().hex
    yield value
    left = wait_gone(value, grace=10)
    assert left == [], f"processes of the job survived it: {left}"


def wait_for(
    what: str, predicate: Callable[[], Any], timeout: float, job: Job | None = None
) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            seen = "" if job is None else f"\n{job.story()}"
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{seen}")
        time.sleep(0.05)
    return value


class Job:
    """``planaria run`` inside the master's namespace, its nodes in n0, n1 (and n2)."""

    def __init__(
        self,
        net: Network,
        workdir: Path,
        mark: str,
        chaos: list[dict[str, object]] | None = None,
        **master: object,
    ) -> None:
        self.net = net
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        config = {
            "job": {
                "name": "partition",
                "command": COMMAND,
                "nodes": 2,
                "procs_per_node": 1,
                "max_restarts": 3,
                # A warm interpreter with torch preloaded takes seconds to start here, and
                # the agent is silent while it waits for it: longer than this job's
                # heartbeat timeout on a loaded machine.
                "preload": [],
                "stop_grace": "2s",
            },
            "scheduler": {
                "backend": "local",
                "options": {
                    "netns": [net.netns(n) for n in ("n0", "n1", "n2")],
                    # Like a cluster's scheduler, this one cannot stop a cut-off node.
                    "keep_replaced": True,
                    "stop_grace": "2s",
                },
            },
            "rendezvous": {"join_grace": "1s", "join_timeout": "60s"},
            "master": {
                "host": net.address("master"),
                "heartbeat_interval": f"{HEARTBEAT_INTERVAL}s",
                "heartbeat_timeout": f"{HEARTBEAT_TIMEOUT}s",
                **master,
            },
            "diagnosis": {"checks": []},
        }
        if chaos:
            config["chaos"] = chaos
        (workdir / "job.yaml").write_text(yaml.safe_dump(config))
        self.output = workdir / "output.txt"
        env = {**os.environ, MARK: mark, "COLUMNS": "200"}
        argv = [sys.executable, "-m", "planaria", "run", "job.yaml"]
        with self.output.open("w") as out:
            self.proc = subprocess.Popen(
                net.exec("master", argv), cwd=workdir, env=env, stdout=out, stderr=out
            )

    def step(self) -> int:
        """The newest step rank 0 logged."""
        logs = list(self.workdir.glob("planaria-runs/*/logs/rank-0.log"))
        if not logs:
            return -1
        steps = [int(line.split()[1]) for line in logs[0].read_text().splitlines()
                 if line.startswith("step ")]  # fmt: skip
        return max(steps, default=-1)

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        timelines = list(self.workdir.glob("planaria-runs/*/events.jsonl"))
        if not timelines:
            return []
        lines = timelines[0].read_text().splitlines()
        # The last line may be half written.
        found = []
        for line in lines:
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return [e for e in found if kind is None or e["kind"] == kind]

    def training(self, at_least: int, timeout: float = 60) -> int:
        return int(
            wait_for(
                f"rank 0 to log step {at_least}",
                lambda: self.step() >= at_least and self.step(),
                timeout,
                self,
            )
        )

    def finish(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the job did not end within {timeout:g}s\n{self.story()}"
            ) from None

    def story(self) -> str:
        """What the job did so far: its events, then the end of its output."""
        lines = [f"{e['time']} {e['kind']}: {e['message']}" for e in self.events()]
        return "\n".join(["events:", *lines, "output:", self.tail()])

    def tail(self, chars: int = 3000) -> str:
        return self.output.read_text()[-chars:]

    def stop(self) -> None:
        """End ``planaria run`` (and so its nodes) if it still runs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def weights(self) -> dict[str, Any]:
        return dict(torch.load(self.workdir / "final.pt", weights_only=True, map_location="cpu"))


@pytest.fixture
def job(network: Callable[..., Network], tmp_path: Path, mark: str) -> Iterator[Callable[..., Job]]:
    started: list[Job] = []

    def start(chaos: list[dict[str, object]] | None = None, **master: object) -> Job:
        one = Job(network(*PARTICIPANTS), tmp_path / f"job-{len(started)}", mark, chaos, **master)
        started.append(one)
        return one

    yield start
    for one in started:
        one.stop()


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The final weights of the same job, in the same namespaces, without a fault."""
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    mark = uuid.uuid4().hex
    with Network(PARTICIPANTS) as net:
        one = Job(net, tmp_path_factory.mktemp("fault-free"), mark)
        try:
            assert one.finish(timeout=120) == 0, one.tail()
        finally:
            one.stop()
        assert one.events("workers_restarted") == []
        weights = one.weights()
    assert marked_processes(mark) == []
    return weights


def assert_same_weights(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got.keys() == expected.keys()
    differ = [key for key in expected if not torch.equal(got[key], expected[key])]
    assert not differ, f"weights differ from the fault-free run's: {differ}"


def test_a_cut_shorter_than_the_heartbeat_timeout_costs_no_restart(
    job: Callable[..., Job], fault_free: dict[str, Any]
) -> None:
    run = job()
    run.training(CUT_AT)
    before = run.step()
    run.net.cut("n1")
    time.sleep(SHORT_CUT)
    during = run.step()
    run.net.heal("n1")
    # The cut was real: rank 0's DDP step waits on the worker in n1, so training stalled.
    assert during - before <= 1, (before, during)
    assert run.finish() == 0, run.tail()
    assert "succeeded" in run.tail()
    assert run.events("fault_detected") == []
    assert run.events("workers_restarted") == []
    assert run.events("node_replaced") == []
    assert run.events("checkpoint_committed")  # flash checkpoints work across namespaces
    assert_same_weights(run.weights(), fault_free)


def test_a_cut_longer_than_the_timeout_replaces_the_node_which_stops_once_healed(
    job: Callable[..., Job], fault_free: dict[str, Any]
) -> None:
    # The old node must still be waiting for the master when the cut heals, and the job
    # still running when its first request after the heal gets through: on a loaded machine
    # the replacement's round can take longer than the default grace (60 s), past which the
    # old node would stop by itself, and the job could end (stopping every node) first. So
    # rank 0 stops itself at step 30 of the round after the loss until the old node is out.
    hold = {"kind": "stop_worker", "rank": 0, "at_step": 30, "attempt": 1}
    run = job(chaos=[hold], grace="600s")
    run.training(CUT_AT)
    old = run.net.pids("n1")
    assert old
    run.net.cut("n1")
    cut_at = time.monotonic()
    lost, *_ = wait_for("node-1 to be lost", lambda: run.events("fault_detected"), 30, run)
    assert lost["node"] == "node-1" and lost["data"]["fault"] == "node_lost", lost
    (replaced,) = wait_for("node-1's replacement", lambda: run.events("node_replaced"), 30, run)
    assert replaced["data"]["replacement"] == "node-2"
    # The replacement runs in the spare namespace and the job trains on without node-1.
    wait_for("training to go on", lambda: run.events("recovered"), 90, run)
    assert run.net.pids("n2")
    # The old node, cut off, was never told anything: it is still there.
    assert set(old) <= set(run.net.pids("n1"))

    run.net.heal("n1")
    cut_for = time.monotonic() - cut_at
    healed_at = time.monotonic()
    # Its first packet after the heal waits out TCP's backoff (up to as long as the cut
    # lasted); then the master tells it it is out of the job, and it stops its workers.
    bound = cut_for + 15
    wait_for("the old node's processes to end", lambda: not run.net.pids("n1"), bound, run)
    stopped_after = time.monotonic() - healed_at
    # It was stopped by the master's word (its agent exits 0 then, below). Either a request of
    # it reached the master again and was fenced; or, after a cut longer than its pings (a
    # busy machine), its standing /actions, sent again on a new connection, got the reply the
    # master kept for it since it declared the node lost: exit.
    fenced = run.events("node_fenced")
    assert [e["node"] for e in fenced] in ([], ["node-1"]), run.story()
    assert run.proc.poll() is None, "the job ended before the old node heard from it"
    # Rank 0, held at step 30, goes on.
    (held,) = wait_for("rank 0 to stop at step 30", lambda: stopped(run.net.pids()), 90, run)
    os.kill(held, signal.SIGCONT)

    assert run.finish() == 0, run.tail()
    assert re.search(r"node stopped .* node=node-1 returncode=0", run.tail(100_000)), run.tail()
    assert len(run.events("workers_restarted")) == 1
    rounds = run.events("rendezvous_completed")
    assert rounds[-1]["data"]["restore"] == "storage"  # the replacement held nothing in memory
    assert run.events("checkpoint_committed")
    assert_same_weights(run.weights(), fault_free)
    print(f"old node stopped {stopped_after:.1f}s after the heal (cut {cut_for:.1f}s)")


def stopped(pids: list[int]) -> list[int]:
    """The processes among ``pids`` stopped by a signal (state T)."""
    return [pid for pid in pids if (stat := proc_stat(pid)) is not None and stat.state == "T"]


def test_a_cut_master_within_its_grace_costs_no_restart(
    job: Callable[..., Job], fault_free: dict[str, Any]
) -> None:
    run = job(grace="20s")
    run.training(CUT_AT)
    run.net.cut("master")
    time.sleep(HEARTBEAT_TIMEOUT * 2)
    run.net.heal("master")
    assert run.finish(timeout=60) == 0, run.tail()
    assert run.events("fault_detected") == []
    assert run.events("workers_restarted") == []
    assert_same_weights(run.weights(), fault_free)
