"""``srun planaria run --rdzv-endpoint ...`` on a real Slurm cluster: one launcher per node
in one step, as ``srun torchrun`` runs, with no Slurm scheduler involved (the master's is
``external``). The step runs on the allocation's first two nodes, hosts of their own: the
endpoint is the first one's address, and ``--node-rank $SLURM_NODEID`` makes its launcher the
master's."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import slurm

pytestmark = pytest.mark.usefixtures("slurm_cluster")
pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "train_gpt.py"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_srun_starts_a_launcher_on_every_node_and_they_train_as_one_job(
    tmp_path, allocation, slurm_network
):
    # A node set down by an earlier test is out of the allocation (--no-kill) for good.
    allocated = slurm("squeue", "-h", "-j", allocation, "-o", "%N").stdout.strip()
    first, second = slurm("scontrol", "show", "hostnames", allocated).stdout.split()[:2]
    line = (
        f"exec {sys.executable} -m planaria run --nnodes 2 --nproc-per-node 1 "
        f"--node-rank $SLURM_NODEID --rdzv-backend c10d --rdzv-endpoint "
        f"{slurm_network.address(first)}:{_free_port()} --set rendezvous.join_grace=2s "
        "--set 'diagnosis.checks=[]' "
        f"{EXAMPLE} --steps 6 --ckpt-every 3"
    )
    env = {**os.environ, "PLANARIA_TOKEN": secrets.token_hex(16)}
    result = subprocess.run(
        [
            "srun",
            f"--jobid={allocation}",
            "-N2",
            f"--nodelist={first},{second}",
            "--ntasks-per-node=1",
            "--overlap",
            "--export=ALL",
            "--kill-on-bad-exit=0",
            "--label",
            "bash",
            "-c",
            line,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "0: planaria: job" in output and "1: planaria: joining the job master" in output
    (timeline,) = tmp_path.glob("planaria-runs/*/events.jsonl")
    events = [json.loads(line) for line in timeline.read_text().splitlines()]
    (round_,) = [e for e in events if e["kind"] == "rendezvous_completed"]
    assert "2 node(s), world size 2" in round_["message"]
    assert {e.get("node") for e in events} >= {"node-0", "node-1"}
    (finished,) = [e for e in events if e["kind"] == "job_finished"]
    assert finished["data"]["state"] == "succeeded"
