"""The benchmarks' package: every script starts by its path from anywhere and as a module of
the package, and the shared harness reads a fault's trial and prints its ratio to a baseline."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [
    "recovery",
    "checkpoint",
    "faults",
    "control_plane",
    "events_scale",
    "goodput_sim",
    "replica_cost",
]
"""The benchmarks this environment can start (the others need a plugin's environment)."""


@pytest.fixture
def harness(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(ROOT))
    return importlib.import_module("benchmarks.harness")


def _help(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_benchmark_starts_by_its_path_from_another_directory(name: str, tmp_path: Path) -> None:
    proc = _help([str(ROOT / "benchmarks" / f"{name}.py")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: {name}.py"), proc.stdout


def test_a_benchmark_starts_as_a_module_of_the_package() -> None:
    proc = _help(["-m", "benchmarks.recovery"], ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--scheduler" in proc.stdout
    assert all(option in proc.stdout for option in ("--kill-rank", "--store", "--standby"))


def test_the_node_loss_benchmark_has_a_row_for_each_rank_lost_and_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    node = importlib.import_module("benchmarks.recovery_node")
    assert node.rows([1], ["rank0"]) == [("planaria", 1, "rank0", 0)]  # the row it always had
    assert node.rows([0, 1, 0], ["rank0", "master"]) == [
        ("planaria r0 rank0", 0, "rank0", 0),
        ("planaria r0 master", 0, "master", 0),
        ("planaria", 1, "rank0", 0),
        ("planaria r1 master", 1, "master", 0),
    ]
    assert node.rows([1, 0], ["master"], [1]) == [
        ("planaria standby r1 master", 1, "master", 1),
        ("planaria standby r0 master", 0, "master", 1),
    ]


RANK0 = """\
step 9 loss 5.0 time 100.0
step 10 loss 5.0 time 101.0
resumed from step 8 (memory)
step 9 loss 5.0 time 104.0
"""


def test_a_fault_struck_from_outside_is_measured_from_when_it_struck(harness) -> None:  # type: ignore[no-untyped-def]
    trial = harness.measure_fault(RANK0, 101.5, True, 30.0, "")
    assert trial.ok and trial.mttr == pytest.approx(2.5) and trial.steps_lost == 2
    never = harness.measure_fault(RANK0, None, False, 30.0, "")
    assert not never.ok and never.note == "the fault never struck"
    # A run that failed or hung recovered from nothing, whatever steps it logged.
    hung = harness.measure_fault(RANK0, 101.5, False, 90.0, "timed out (hang)")
    assert not hung.ok and hung.mttr is None and hung.note == "timed out (hang)"


def test_the_fault_table_shows_no_ratio_for_a_runner_that_never_recovered(
    harness, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    def figures(mttr: float | None) -> dict[str, object]:
        return {"mttr": mttr, "steps_lost": 0, "failed": 0 if mttr else 1}

    result = harness.fault_table(
        {
            "kill: mine": figures(1.0),
            "kill: base": figures(4.0),
            "node: mine": figures(None),
            "node: base": figures(8.0),
        },
        ("mine", "mine", "mine"),
        ("base", "base", "base"),
    )
    assert result["worker_kill_ratio"] == pytest.approx(0.25)
    assert result["node_loss_ratio"] is None and result["node_loss_mine_failed"] == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["worker", "kill", "1.00s", "4.00s", "0.25"]
    assert lines[2].split() == ["node", "loss", "failed", "8.00s", "-"]
    assert harness.ratio(2.0, 0.0) is None and harness.ratio(None, 1.0) is None


def test_the_node_loss_rows_show_steps_redone_and_the_ratio_to_their_baseline(
    harness, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    figures = {
        "node: ray": {"mttr": 8.0, "steps_lost": 3, "failed": 0},
        "node: ray standby+replica": {"mttr": 2.0, "steps_lost": 0, "failed": 0},
        "node: ray replica": {"mttr": None, "steps_lost": None, "failed": 1},
    }
    result = harness.node_loss_rows(figures, ["ray standby+replica", "ray replica"], "ray")
    assert result["node_loss_ray_standby_replica_mttr_s"] == 2.0
    assert result["node_loss_ray_standby_replica_steps_redone"] == 0
    assert result["node_loss_ray_replica_failed"] == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-7:] == ["2.00s", "steps", "redone", "0", "x", "ray", "0.25"]
    assert lines[1].split()[-7:] == ["failed", "steps", "redone", "None", "x", "ray", "-"]


def test_the_node_of_a_rank_is_the_one_of_the_newest_round(harness, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    assert harness.node_of_rank(tmp_path, 1) is None  # no run yet
    run = tmp_path / "planaria-runs" / "r1"
    run.mkdir(parents=True)
    rounds = [{"node-0": 0, "node-2": 1}, {"node-0": 0, "node-1": 1}]
    lines = [json.dumps({"kind": "rendezvous_completed", "data": {"ranks": r}}) for r in rounds]
    (run / "events.jsonl").write_text("\n".join([*lines, '{"kind": "torn']) + "\n")
    assert harness.node_of_rank(tmp_path, 1) == "node-1"
    assert harness.node_of_rank(tmp_path, 0) == "node-0"


@pytest.mark.slow  # five runs of a 24-step job with a node lost in each
def test_the_node_loss_benchmark_measures_every_row_and_leaves_nothing(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "recovery.py"), "--node-loss",
         "--trials", "1", "--steps", "24", "--kill-at", "12", "--ckpt-every", "4"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["fault"] == "node_loss" and result["left_behind"] == 0, result
    rows = ("planaria", "planaria_standby", "planaria_replica", "planaria_standby+replica")
    for name in rows:
        # Recovered, redoing at most the steps since the last persist (every 4); with a
        # replica, at most the step the lost node's last copy may lag by.
        assert result[f"{name}_failed"] == 0, proc.stdout[-3000:]
        assert isinstance(result[f"{name}_mttr_s"], float) and result[f"{name}_mttr_s"] > 0
        most = 1 if "replica" in name else 4
        assert 0 <= result[f"{name}_steps_redone"] <= most, result
    # torchrun's figure is the baseline: there, or a failure the table names.
    assert (result["torchrun_failed"] == 0) == isinstance(result["torchrun_mttr_s"], float)
    assert "node loss: SIGKILL of every process of node 1" in proc.stdout


def test_the_replica_cost_reads_step_times_and_copies_a_step_to_a_buddy(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    replica_cost = importlib.import_module("benchmarks.replica_cost")
    log = "\n".join(f"step {s} loss 1.0 time {100 + s * 0.5 + (s % 2) * 0.1:.6f}" for s in range(6))
    times = replica_cost.step_times(log + "\nresumed from step 3 (memory)\n", skip=2)
    assert times == pytest.approx([0.6, 0.4, 0.6])  # steps 2-3, 3-4, 4-5
    copied = replica_cost.copy_cost(gib=4 / 1024, copies=2)  # 4 MiB, twice, over loopback
    assert copied["copy_s"] > 0 and copied["copy_cpu_s"] >= 0
