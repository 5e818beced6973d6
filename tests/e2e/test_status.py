"""``planaria status`` against a real running job (asked of its master, with the token from its
run directory or from PLANARIA_TOKEN), after it ended (read from the run directory), and on a
path that is no run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from planaria.testing.jobs import EXAMPLE, job, start
from support.cli import status, status_json

pytest.importorskip("torch")


def _wait(tmp_path: Path, proc: subprocess.Popen[str], until, timeout: float = 120) -> dict:
    """``status --json`` of the job's run directory, polled until ``until(view)``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        found = list(tmp_path.glob("planaria-runs/*/master.db"))
        # A journal being made (its tables not there yet) is no status yet.
        result = status(str(found[0].parent), "--json") if found else None
        if result is not None and result.returncode == 0:
            view = json.loads(result.stdout)
            if until(view):
                return view
        time.sleep(0.5)
    raise AssertionError("the job's status never got there")


@pytest.mark.slow
def test_status_of_a_running_job_then_of_the_job_over(tmp_path, mark):
    """The scheduler labels the nodes' hosts (the local scheduler's ``topology`` option, as
    Slurm's topology plugin would): each node shows its labels, asked of the master and read
    from the journal after."""
    command = [sys.executable, str(EXAMPLE), "--steps", "100000", "--ckpt-every", "50"]
    switches = {"local-0": {"switch": "s1"}, "local-1": {"switch": "s2"}}
    config = job(
        tmp_path,
        job={"command": command, "procs_per_node": 1},
        scheduler={"backend": "local", "options": {"topology": switches}},
    )
    proc = start(tmp_path, mark, str(config))
    try:
        first = _wait(tmp_path, proc, lambda v: v["running"] and v["step"] >= 1)
        (run_dir,) = tmp_path.glob("planaria-runs/*")
        assert first["state"] == "running" and first["source"].startswith("http://127.0.0.1:")
        assert first["run_id"] == run_dir.name and first["job"] == "e2e"
        nodes = {n["node_id"]: n for n in first["nodes"]}
        assert set(nodes) == {"node-0", "node-1"}
        assert sorted(n["node_rank"] for n in nodes.values()) == [0, 1]
        assert all(
            n["host"].startswith("local-") and n["state"] == "running" for n in nodes.values()
        )
        assert {n["node_id"]: n["topology"] for n in nodes.values()} == {
            "node-0": {"switch": "s1"},
            "node-1": {"switch": "s2"},
        }
        assert any(e["kind"] == "rendezvous_completed" for e in first["events"])
        later = _wait(tmp_path, proc, lambda v: v["step"] > first["step"] + 2)
        assert later["running"] and max(n["step"] for n in later["nodes"]) == later["step"]

        # --master with the token in the environment, no run directory.
        token = (run_dir / "token").read_text().strip()
        asked = status_json("--master", first["source"], env={"PLANARIA_TOKEN": token})
        assert asked["running"] and asked["run_id"] == run_dir.name
        refused = status("--master", first["source"], env={"PLANARIA_TOKEN": "wrong"})
        assert refused.returncode == 2 and "answered 401" in refused.stderr

        text = status(str(run_dir))
        assert text.returncode == 0, text.stderr
        assert "e2e" in text.stdout and "running" in text.stdout and "node-1" in text.stdout
        row = next(line for line in text.stdout.splitlines() if "node-1" in line)
        assert "topology" in text.stdout and "switch=s2" in row, text.stdout
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)

    over = status_json(str(run_dir))
    assert not over["running"] and over["state"] == "failed"
    assert "interrupted by SIGINT" in over["reason"]
    assert {n["node_id"]: n["topology"] for n in over["nodes"]} == {
        "node-0": {"switch": "s1"},
        "node-1": {"switch": "s2"},
    }
    assert over["step"] >= later["step"]
    assert over["events"][-1]["kind"] == "job_stopped"
    text = status(str(run_dir))
    assert text.returncode == 0 and "failed (over)" in text.stdout
    row = next(line for line in text.stdout.splitlines() if "node-0" in line)
    assert "switch=s1" in row, text.stdout


def test_a_path_that_is_no_run_is_a_clear_error(tmp_path):
    result = status(str(tmp_path / "nowhere"))
    assert result.returncode == 2
    assert f"{tmp_path / 'nowhere'} does not exist" in result.stderr
    result = status(str(tmp_path))
    assert result.returncode == 2 and "is not a planaria run directory" in result.stderr
    result = status()
    assert result.returncode == 2 and "give a run directory" in result.stderr


def test_status_of_an_ended_run_on_a_read_only_mount(tmp_path, mark):
    from test_run import run

    config = job(tmp_path, job={"nodes": 1, "procs_per_node": 1})
    done = run(tmp_path, mark, str(config), "--", sys.executable, "-c", "pass")
    assert done.returncode == 0, done.stdout[-2000:]
    (run_dir,) = (p.parent for p in tmp_path.glob("planaria-runs/*/master.db"))
    mounted = os.geteuid() == 0  # root writes past a mode: a read-only mount stops it
    if mounted:
        subprocess.run(["mount", "--bind", str(run_dir), str(run_dir)], check=True)
    try:
        if mounted:
            subprocess.run(["mount", "-o", "remount,ro,bind", str(run_dir)], check=True)
        else:
            run_dir.chmod(0o500)
        with pytest.raises(OSError):
            (run_dir / "probe").touch()
        view = status_json(str(run_dir))
        assert view["state"] == "succeeded" and not view["running"]
        text = status(str(run_dir))
        assert text.returncode == 0 and "succeeded (over)" in text.stdout, text.stderr
        assert view["nodes"][0]["topology"] == {}
        assert "topology" not in text.stdout  # no labels: no column for them
    finally:
        if mounted:
            subprocess.run(["umount", str(run_dir)], check=True)
        else:
            run_dir.chmod(0o700)
    assert not list(run_dir.glob("master.db-*"))
