"""``srun planaria run --rdzv-endpoint ...`` on a real Slurm cluster: one launcher per node
in one step, as ``srun torchrun`` runs, with no Slurm scheduler involved (the master's is
``external``).

Nothing here assumes that the nodes share one host: each task finds the endpoint as a user's
line would, from Slurm (the ``NodeAddr`` of the step's first node, its node 0, the address
Slurm itself reaches it at), and ``--node-rank $SLURM_NODEID`` says which launcher is the
master's. The test reads the master's address from what the launcher printed."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import nodes_of

pytestmark = pytest.mark.usefixtures("slurm_cluster")
torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "train_gpt.py"
SETTINGS = (
    "--set rendezvous.join_grace=2s --set rendezvous.join_timeout=120s "
    "--set master.heartbeat_interval=1s --set master.heartbeat_timeout=6s "
    "--set 'diagnosis.checks=[]'"
)
SCRIPT = f"{EXAMPLE} --steps 20 --ckpt-every 4 --out final.pt"
HEAD = (
    'HEAD=$(scontrol show hostnames "$SLURM_STEP_NODELIST" | head -n1); '
    'ADDR=$(scontrol show node "$HEAD" | grep -o "NodeAddr=[^ ]*" | cut -d= -f2); '
)
"""The step's node 0 and the address the nodes reach it at, found on every node."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launcher(endpoint: str, rank: str, chaos: tuple[str, ...] = ()) -> str:
    """One task's bash line: it leaves its pid (the launcher's, after exec) for the test to
    kill the node by."""
    rules = " ".join(f"--chaos '{rule}'" for rule in chaos)
    return (
        f"echo $$ > launcher-{rank}.pid; exec {sys.executable} -m planaria run --nnodes 2 "
        f"--nproc-per-node 2 --node-rank {rank} --rdzv-backend c10d --rdzv-endpoint {endpoint} "
        f"{SETTINGS} {rules} {SCRIPT}"
    )


def _srun(allocation: str, nodes: int, line: str, *where: str) -> list[str]:
    return [
        "srun",
        f"--jobid={allocation}",
        f"-N{nodes}",
        *where,
        "--ntasks-per-node=1",
        "--overlap",
        "--export=ALL",
        "--kill-on-bad-exit=0",
        "--label",
        "bash",
        "-c",
        line,
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "PLANARIA_TOKEN": secrets.token_hex(16)}


def _events(workdir: Path) -> list[dict]:
    (timeline,) = workdir.glob("planaria-runs/*/events.jsonl")
    lines = timeline.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def _weights(workdir: Path) -> dict:
    return torch.load(workdir / "final.pt", weights_only=True, map_location="cpu")


@pytest.fixture(scope="module")
def clean(allocation: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A fault-free two-node run: its directory and its output."""
    workdir = tmp_path_factory.mktemp("clean")
    line = HEAD + _launcher(f"$ADDR:{_free_port()}", "$SLURM_NODEID")
    result = subprocess.run(
        _srun(allocation, 2, line),
        cwd=workdir,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return workdir, output


def test_srun_starts_a_launcher_on_every_node_and_they_train_as_one_job(clean, allocation):
    workdir, output = clean
    assert "0: planaria: job" in output and "1: planaria: joining the job master" in output
    events = _events(workdir)
    (round_,) = [e for e in events if e["kind"] == "rendezvous_completed"]
    assert "2 node(s), world size 4" in round_["message"]
    assert {e.get("node") for e in events} >= {"node-0", "node-1"}
    (finished,) = [e for e in events if e["kind"] == "job_finished"]
    assert finished["data"]["state"] == "succeeded"


def test_a_worker_kill_and_a_node_lost_and_started_again_end_bitwise_as_without(
    clean, allocation, tmp_path
):
    """What the ``external`` scheduler promises a fixed-size job: a worker that dies is
    restarted in place; a node whose launcher dies (the whole task: launcher, agent, workers,
    SIGKILLed as a lost machine's are) is waited for, and the same launcher started again,
    here by another srun on a spare node of the allocation with ``--node-rank 1``, takes its
    slot. The world size never changes, so the weights must be bitwise the clean run's.

    Every worker hangs at step 12 of the second attempt, so that the node is lost at a known
    point whatever the machine's speed (the hang rule fires in that attempt only)."""
    chaos = (
        "kill_worker rank=3 at_step=6",
        *(f"hang_worker rank={r} at_step=12 attempt=1" for r in range(4)),
    )
    line = HEAD + _launcher(f"$ADDR:{_free_port()}", "$SLURM_NODEID", chaos)
    env = _env()
    nodes = nodes_of(allocation)
    first = (tmp_path / "step.out").open("w")
    step = subprocess.Popen(
        _srun(allocation, 2, line, f"--nodelist={nodes[0]},{nodes[1]}"),
        cwd=tmp_path,
        env=env,
        stdout=first,
        stderr=subprocess.STDOUT,
        text=True,
    )
    again: subprocess.Popen[str] | None = None
    try:
        _until(tmp_path, step, lambda e: "hang_worker rank=" in _said(tmp_path), "a hang")
        pid = int((tmp_path / "launcher-1.pid").read_text())
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)  # node 1's launcher: the agent runs in it
        _until(
            tmp_path,
            step,
            lambda e: e["kind"] == "fault_detected" and e.get("node") == "node-1",
            "node 1's loss",
        )
        said = (tmp_path / "step.out").read_text()
        endpoint = re.search(r"0: planaria: job .* master at https://(\S+)", said)
        assert endpoint is not None, said
        relaunch = _launcher(endpoint.group(1), "1")
        second = (tmp_path / "again.out").open("w")
        again = subprocess.Popen(
            _srun(allocation, 1, relaunch, f"--nodelist={nodes[2]}"),
            cwd=tmp_path,
            env=env,
            stdout=second,
            stderr=subprocess.STDOUT,
            text=True,
        )
        step_code, again_code = step.wait(timeout=300), again.wait(timeout=300)
    finally:
        for proc in (step, again):
            if proc is not None and proc.poll() is None:
                proc.terminate()  # srun passes it on to the step's tasks
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    output = (tmp_path / "step.out").read_text() + (tmp_path / "again.out").read_text()
    assert again_code == 0, output
    # srun's own account: task 0 ended well, task 1 was killed.
    assert step_code != 0 and re.search(r"task 1: Killed", output), output
    assert "1: planaria: joining the job master" in output, output

    events = _events(tmp_path)
    kills = [e for e in events if e["kind"] == "fault_detected" and e["data"].get("signal") == 9]
    assert kills, [e for e in events if e["kind"] == "fault_detected"]
    lost = [
        e
        for e in events
        if e["kind"] == "fault_detected" and "lost" in e["message"] and e["time"] >= killed_at
    ]
    assert [e["node"] for e in lost] == ["node-1"], lost
    rounds = [e for e in events if e["kind"] == "rendezvous_completed"]
    assert len(rounds) >= 3 and all("world size 4" in e["message"] for e in rounds), rounds
    (finished,) = [e for e in events if e["kind"] == "job_finished"]
    assert finished["data"]["state"] == "succeeded"

    a, b = _weights(clean[0]), _weights(tmp_path)
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a)


def _said(workdir: Path) -> str:
    return (workdir / "step.out").read_text()


def _until(
    workdir: Path, proc: subprocess.Popen[str], seen: Callable[[dict], bool], what: str
) -> None:
    """Wait until an event of the job's timeline is ``seen``, while the step runs."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if list(workdir.glob("planaria-runs/*/events.jsonl")) and any(
            seen(e) for e in _events(workdir)
        ):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    pytest.fail(f"no {what}:\n" + (workdir / "step.out").read_text()[-8000:])
