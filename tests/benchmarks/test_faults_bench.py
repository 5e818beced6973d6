"""The fault suite (benchmarks/faults.py) keeps working: one cheap row, end to end, and its CLI.

The whole suite takes minutes; one row (a worker SIGKILLed) runs the same machinery: the
fault-free reference, a trial watched through its timeline, the bitwise comparison, the
process sweep and the last JSON line that is the suite's contract.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "faults.py"
ROW_KEYS = {"fault": str, "survived": bool, "bitwise_equal": bool, "steps_lost": int}


def faults(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def trial_processes() -> list[int]:
    """Processes of any trial of the suite (each carries PLANARIA_FAULTS_MARK)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            status = (entry / "status").read_text()
        except OSError:
            continue
        if any(e.startswith(b"PLANARIA_FAULTS_MARK=") for e in environ) and "State:\tZ" not in (
            status
        ):
            found.append(int(entry.name))
    return found


def test_one_row_survives_and_ends_with_the_json_line_of_the_contract() -> None:
    result = faults("--only", "worker-sigkill")
    output = result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(report) == {"faults", "all_passed"}, report
    (row,) = report["faults"]
    assert set(row) == {*ROW_KEYS, "recovery_s"}, row
    for key, kind in ROW_KEYS.items():
        assert type(row[key]) is kind, (key, row)
    assert isinstance(row["recovery_s"], float)
    assert row["fault"] == "worker-sigkill"
    # A worker kill is restarted in place from memory: no step lost, the weights bitwise equal.
    assert row["survived"] and row["bitwise_equal"], output
    assert row["steps_lost"] == 0 and 0 < row["recovery_s"] < 60, row
    assert report["all_passed"] is True and result.returncode == 0, output
    table = [line for line in result.stdout.splitlines() if line.startswith("worker-sigkill")]
    assert len(table) == 1 and "restarted in place" in table[0], result.stdout
    assert trial_processes() == [], "the suite left processes of its trials running"


NOBODY = 65534


def test_the_partition_row_without_root_fails_the_suite_and_says_why() -> None:
    """The partition row puts the job in network namespaces, which need root; without root it
    fails at once (no trial runs), saying so. As root, the suite is run as ``nobody``."""
    drop: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root, and no `setpriv` (util-linux) to drop it")
        drop = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    result = subprocess.run(
        [*drop, sys.executable, str(BENCH), "--only", "partition"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd="/",
    )
    if drop and "Permission denied" in result.stderr:
        pytest.skip(f"user {NOBODY} cannot read the suite here: {result.stderr[-300:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {
        "faults": [
            {
                "fault": "partition",
                "survived": False,
                "bitwise_equal": False,
                "steps_lost": 0,
                "recovery_s": 0.0,
            }
        ],
        "all_passed": False,
    }
    (row,) = [line for line in result.stdout.splitlines() if line.startswith("partition")]
    assert row.endswith("needs root (network namespaces)"), row
    assert result.returncode == 1


def test_list_names_every_row_and_an_unknown_name_is_refused_with_the_choices() -> None:
    listed = faults("--list", timeout=60)
    assert listed.returncode == 0, listed.stderr
    names = [line.split()[0] for line in listed.stdout.splitlines()]
    assert len(names) == 14 and "worker-sigkill" in names and "agent-sigkill-standby" in names
    assert "agent-sigkill-replica" in names
    bad = faults("--only", "worker-sigkill,no-such-fault", timeout=60)
    assert bad.returncode != 0
    assert "unknown fault(s) no-such-fault" in bad.stderr and "worker-sigkill" in bad.stderr
