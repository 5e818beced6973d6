"""docs/slurm.md's recipes, run as they are written: the multi-host batch script goes to
sbatch on the test cluster, its GPU parts turned off from sbatch's command line the way the
doc says to try it on CPUs (``--gpus-per-node=0``, ``GPUS`` and ``DEVICE`` exported); the
``planaria submit`` job file is submitted dry."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "slurm.md"
EXAMPLE = ROOT / "examples" / "train_gpt.py"
TRAIN = f"""\
import os, runpy, sys
names = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "PLANARIA_TOKEN")
print(" ".join(f"{{n}}={{os.environ.get(n, '-')}}" for n in names), flush=True)
sys.argv = [{str(EXAMPLE)!r}, *sys.argv[1:], "--steps", "8", "--ckpt-every", "4"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
"""The doc's ``train.py``: planaria's example GPT, a few steps, after saying what of the
batch script's environment the worker sees."""


def _block(language: str, *holding: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), re.DOTALL)
    (found,) = [b for b in blocks if all(h in b for h in holding)]
    return found


@pytest.mark.usefixtures("slurm_cluster")
def test_the_multi_host_batch_script_runs_as_written(tmp_path):
    pytest.importorskip("torch")
    script = _block("bash", "#!/bin/bash", "--rdzv-endpoint")
    (tmp_path / "gpt.sbatch").write_text(script)
    (tmp_path / "train.py").write_text(TRAIN)
    shared = tmp_path / "shared"
    bin_dir = Path(sys.executable).parent  # planaria and python, as on the nodes' PATH
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        [
            "sbatch",
            "--wait",
            "--parsable",
            "--nodes=2",
            "--gpus-per-node=0",
            "--oversubscribe",  # beside the allocation other tests hold
            f"--export=ALL,GPUS=1,DEVICE=cpu,SHARED={shared}",
            "gpt.sbatch",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    job_id = result.stdout.strip().split(";")[0]
    outputs = list(tmp_path.glob("gpt-*.out"))
    said = "\n".join(p.read_text() for p in outputs)
    assert result.returncode == 0, f"{result.stderr}\n{said}"
    assert [p.name for p in outputs] == [f"gpt-{job_id}.out"]
    # Every worker saw the batch script's NCCL settings, and no worker the job's token.
    for rank in (0, 1):
        assert f"[rank{rank}]: NCCL_SOCKET_IFNAME=ib0 NCCL_IB_HCA=mlx5 PLANARIA_TOKEN=-" in said
    assert "planaria: joining the job master" in said, said

    (timeline,) = shared.glob("runs/*/events.jsonl")
    events = [json.loads(line) for line in timeline.read_text().splitlines()]
    (round_,) = [e for e in events if e["kind"] == "rendezvous_completed"]
    assert "2 node(s), world size 2" in round_["message"]
    assert {e.get("node") for e in events} >= {"node-0", "node-1"}
    (finished,) = [e for e in events if e["kind"] == "job_finished"]
    assert finished["data"]["state"] == "succeeded"
    committed = [e["step"] for e in events if e["kind"] == "checkpoint_committed"]
    assert committed and max(committed) == 7, committed
    # On the shared storage the script names: the checkpoint a requeued job resumes from.
    assert (shared / "checkpoints" / "step-7" / "manifest.json").is_file()


def test_the_submitted_gpu_job_asks_slurm_for_the_gpus_and_the_spare(tmp_path):
    (tmp_path / "gpt.yaml").write_text(_block("yaml", "backend: slurm", "NCCL_SOCKET_IFNAME"))
    result = subprocess.run(
        [sys.executable, "-m", "planaria", "submit", "gpt.yaml", "--dry-run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for line in ("--nodes=5", "--gpus-per-node=8", "--no-kill", "--requeue"):
        assert f"#SBATCH {line}" in lines, result.stdout
