"""examples/train_gpt.py under torchrun: a run interrupted by a fault and resumed from its
checkpoint ends with bitwise the same weights as a run without a fault."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_gpt.py"
# Three ranks, not two: a sum of two floats does not depend on its order, so only with more
# than two ranks would a change in how DDP lays out its gradient buckets after a restart show.
RANKS = 3
STEPS = 30
CKPT_EVERY = 5
FAULT_STEP = 17  # the last checkpoint before it is after step 14


def torchrun(
    tmp_path: Path, name: str, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PLANARIA_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    # torchrun's agent shares its TCPStore with the workers by default, and a restarted
    # attempt can read the previous attempt's gloo addresses from it ("Connection refused" in
    # connectFullMesh): pytorch/pytorch#135712. The documented opt-out avoids it.
    full_env = {
        **clean,
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        **(env or {}),
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(RANKS),
        "--nnodes",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        *extra,
        str(SCRIPT),
        "--steps",
        str(STEPS),
        "--ckpt-every",
        str(CKPT_EVERY),
        "--ckpt-dir",
        str(tmp_path / name / "checkpoints"),
        "--out",
        str(tmp_path / name / "final.pt"),
    ]
    # In its own session, so that a hang kills the workers too, not torchrun alone.
    with subprocess.Popen(
        command,
        cwd=tmp_path,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            pytest.fail(f"torchrun timed out\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def load(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True, map_location="cpu")


@pytest.mark.slow  # three starts of 3 workers under torchrun: 30-36 s on 2 CPU cores
def test_resumed_run_ends_bitwise_equal_to_fault_free_run(tmp_path: Path) -> None:
    pytest.importorskip("planaria.monitor")  # the chaos rule fires in planaria.monitor.step
    clean = torchrun(tmp_path, "clean")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "resumed from" not in clean.stdout
    assert f"done {STEPS} steps" in clean.stdout
    losses = [
        float(line.split()[3]) for line in clean.stdout.splitlines() if line.startswith("step ")
    ]
    assert len(losses) == STEPS
    assert losses[-1] < losses[0] - 1.0  # it learns

    # Rank 2 raises after step FAULT_STEP in the first attempt; torchrun restarts the workers,
    # which resume from the last checkpoint (the rule does not fire in attempt 1).
    rule = {"kind": "raise_in_worker", "rank": 2, "at_step": FAULT_STEP, "attempt": 0}
    faulty = torchrun(
        tmp_path, "faulty", "--max-restarts", "1", env={"PLANARIA_CHAOS": json.dumps([rule])}
    )
    assert faulty.returncode == 0, faulty.stdout + faulty.stderr
    assert f"raise_in_worker rank=2 at_step={FAULT_STEP}" in faulty.stderr
    last_ckpt = FAULT_STEP // CKPT_EVERY * CKPT_EVERY - 1
    # Standalone (torchrun), a restarted worker restores from storage, not from memory.
    assert f"resumed from step {last_ckpt} (storage)" in faulty.stdout
    assert f"done {STEPS} steps" in faulty.stdout

    expected = load(tmp_path / "clean" / "final.pt")
    got = load(tmp_path / "faulty" / "final.pt")
    assert expected.keys() == got.keys()
    differ = [key for key in expected if not torch.equal(expected[key], got[key])]
    assert not differ, f"weights differ after resuming: {differ}"

    # The last persisted step is committed (every rank's shard, the manifest), owner-only.
    last = tmp_path / "faulty" / "checkpoints" / f"step-{STEPS - 1}"
    manifest = json.loads((last / "manifest.json").read_text())
    assert manifest["world"] == RANKS and manifest["step"] == STEPS - 1
    for rank in range(RANKS):
        assert (last / f"rank-{rank}.bin").stat().st_mode & 0o777 == 0o600
