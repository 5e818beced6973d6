"""The GPU benchmarks' code paths where there is no GPU: benchmarks/checkpoint.py --device cuda
end to end on CPU tensors (--cpu-dry-run), its clear refusal without CUDA, and how
benchmarks/recovery_device.py judges a kill during a save."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def checkpoint_bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "core"), *sys.path])}
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / "checkpoint.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )


def test_the_device_checkpoint_benchmark_runs_its_whole_path_on_cpu(tmp_path: Path) -> None:
    proc = checkpoint_bench(
        "--device", "cuda", "--cpu-dry-run", "--size-mib", "4", "--tensors", "12",
        "--runs", "1", "--steps", "1", "--step-matmuls", "1", "--dir", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["device"] == "cpu (dry run)"
    assert report["pass"]["bitwise"] is True
    assert set(report["pass"]) == {
        "save_vs_pinned_d2h",
        "overlapped_blocked_vs_pinned_d2h",
        "restore_vs_pinned_h2d",
        "bitwise",
    }
    assert report["left_behind"] == 0
    for line in ("save_vs_pinned_d2h", "restore_vs_pinned_h2d", "every restore bitwise equal"):
        assert line in proc.stdout
    if report["overlapped"] != "available":  # a Checkpointer without save(blocking=False)
        assert "overlapped save: not available" in proc.stdout
        assert report["pass"]["overlapped_blocked_vs_pinned_d2h"] is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_device_benchmark_says_so() -> None:
    proc = checkpoint_bench("--device", "cuda", "--runs", "1")
    assert proc.returncode != 0
    assert "--device cuda: torch cannot use CUDA here" in proc.stderr
    assert "--cpu-dry-run" in proc.stderr


def test_dry_run_needs_a_device() -> None:
    proc = checkpoint_bench("--cpu-dry-run")
    assert proc.returncode != 0
    assert "give --device cuda with it" in proc.stderr


RANK0 = """\
step 8 loss 5.0 time 100.0
step 9 loss 5.0 time 101.0
step 10 loss 5.0 time 102.0
resumed from step {resumed} (memory)
step {first} loss 5.0 time 104.5
"""
KILLED = "planaria chaos: kill_worker rank=1 at_step=10 in_save time=102.5\n"


@pytest.fixture
def recovery_device(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """benchmarks.recovery_device, imported through the package as its script imports it."""
    monkeypatch.syspath_prepend(str(ROOT))
    return importlib.import_module("benchmarks.recovery_device")


@pytest.mark.parametrize(
    ("resumed", "lost", "missed"),
    [(9, 0, False), (10, 0, True), (5, 4, False)],
)
def test_a_kill_during_a_save_counts_completed_saves_not_restored(
    recovery_device, resumed: int, lost: int, missed: bool
) -> None:  # type: ignore[no-untyped-def]
    """Killed in the save of step 10: step 9 is the newest completed save. Restoring 9 loses
    nothing; restoring 10 means the kill came after that save completed; restoring 5 loses 4."""
    args = argparse.Namespace(kill_at=10)
    log = RANK0.format(resumed=resumed, first=resumed + 1)
    trial = recovery_device.judged(args, log, KILLED, True, 10.0, "", "during")
    assert trial.ok
    assert trial.steps_lost == lost
    assert trial.mttr == pytest.approx(2.0)
    assert ("window missed" in trial.note) is missed
