"""A master that dies does not end the job: its agents keep the workers training for
``master.grace`` and re-attach to a master resumed on the run directory
(``planaria run --resume``), which goes on with the same round from its journal.

Real processes throughout: ``planaria run`` is SIGKILLed from outside mid-training.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from planaria.master.summary import read_summary
from planaria.master.tables import fault_rows
from planaria.process import running

torch = pytest.importorskip("torch")
from planaria.testing.jobs import EXAMPLE, job, run, start  # noqa: E402

STEPS = 60


def _config(tmp_path: Path, grace: str, **extra: object) -> Path:
    out = tmp_path / "final.pt"
    return job(
        tmp_path,
        job={
            "command": [
                sys.executable,
                str(EXAMPLE),
                "--steps",
                str(STEPS),
                "--ckpt-every",
                "5",
                "--out",
                str(out),
            ],
            "nodes": 2,
            "procs_per_node": 1,
            "max_restarts": 3,
        },
        master={"heartbeat_interval": "0.5s", "heartbeat_timeout": "10s", "grace": grace},
        **extra,
    )


def _run_dir(tmp_path: Path) -> Path:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = list(tmp_path.glob("planaria-runs/*/master.db"))
        if found:
            return found[0].parent
        time.sleep(0.1)
    raise AssertionError("no run directory appeared")


def _step(run_dir: Path) -> int:
    """The last step rank 0 logged."""
    log = run_dir / "logs" / "rank-0.log"
    if not log.exists():
        return -1
    steps = [
        int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("step ")
    ]
    return max(steps, default=-1)


def _wait_step(run_dir: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _step(run_dir) < step:
        assert time.monotonic() < deadline, f"training did not reach step {step}"
        time.sleep(0.1)


def _sampled(run_dir: Path) -> dict[str, int]:
    """Each node's last step sampled in the timeline (a partial last line passed over)."""
    found: dict[str, int] = {}
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event["kind"] == "progress":
            found[event["node"]] = int(event["step"])
    return found


def _wait_sampled(run_dir: Path, nodes: int, timeout: float = 60) -> None:
    """Wait until the timeline samples a step of each of ``nodes`` nodes."""
    deadline = time.monotonic() + timeout
    while len(_sampled(run_dir)) < nodes:
        assert time.monotonic() < deadline, f"the timeline sampled no step of {nodes} nodes"
        time.sleep(0.2)


def _events(run_dir: Path) -> list[dict[str, object]]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _weights(path: Path) -> dict[str, object]:
    return torch.load(path, weights_only=True)


def _agent_pids(run_dir: Path) -> list[int]:
    db = sqlite3.connect(run_dir / "master.db")
    try:
        rows = db.execute("SELECT value FROM nodes").fetchall()
    finally:
        db.close()
    return [json.loads(v)["pid"] for (v,) in rows if json.loads(v)["pid"]]


def test_a_master_killed_mid_training_and_resumed_loses_no_step(tmp_path, mark):
    clean = tmp_path / "clean"
    clean.mkdir()
    result = run(clean, mark, str(_config(clean, "30s")))
    assert result.returncode == 0, result.stdout[-3000:]

    faulty = tmp_path / "faulty"
    faulty.mkdir()
    proc = start(faulty, mark, str(_config(faulty, "30s")))
    try:
        run_dir = _run_dir(faulty)
        _wait_step(run_dir, 15)
        agents = _agent_pids(run_dir)
        assert len(agents) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        killed_at = _step(run_dir)
        # The workers go on training without any master.
        _wait_step(run_dir, killed_at + 3, timeout=30)
        assert all(running(pid) for pid in agents)
        resumed = run(faulty, mark, "--resume", str(run_dir))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    events = _events(run_dir)
    kinds = [e["kind"] for e in events]
    assert "master_resumed" in kinds
    assert kinds.count("node_reattached") == 2
    assert "workers_restarted" not in kinds
    assert "fault_detected" not in kinds
    reattached = [e for e in events if e["kind"] == "node_reattached"]
    assert all(not e["data"]["restarted"] for e in reattached)
    assert kinds[-1] == "job_finished"
    # One start of the workers: the rank-0 log never says it resumed from a checkpoint.
    assert "resumed from step" not in (run_dir / "logs" / "rank-0.log").read_text()
    a, b = _weights(clean / "final.pt"), _weights(faulty / "final.pt")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The job's tokens (the example reports 8 x 32 a rank and step, 2 ranks): the resumed
    # master counts on from the timeline's last count, once: never past the steps' worth.
    resumed_at = kinds.index("master_resumed")
    before = [e["data"].get("tokens") for e in events[:resumed_at] if e["kind"] == "progress"]  # type: ignore[attr-defined]
    counted = max((t for t in before if t is not None), default=None)
    summary = read_summary(run_dir)
    assert summary is not None and summary.tokens is not None and counted is not None
    assert counted < summary.tokens <= STEPS * 512 and summary.tokens % 512 == 0


def test_agents_stop_their_workers_once_the_master_is_gone_for_the_grace(tmp_path, mark):
    proc = start(tmp_path, mark, str(_config(tmp_path, "3s")))
    try:
        run_dir = _run_dir(tmp_path)
        _wait_step(run_dir, 3)
        _wait_sampled(run_dir, 2)
        agents = _agent_pids(run_dir)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        killed = time.monotonic()
        known = _sampled(run_dir)  # what the master knew of each node when it died
        deadline = killed + 30
        while any(running(pid) for pid in agents):
            assert time.monotonic() < deadline, "agents outlived the grace by far"
            time.sleep(0.1)
        gone_after = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert gone_after >= 3.0  # they waited the grace first
    logs = "".join(p.read_text() for p in (run_dir / "logs" / "agents").glob("*.log"))
    assert "the master has been gone for the grace" in logs
    # Resumed after its agents gave up, the job still goes on: the new master finds the
    # nodes gone (the scheduler reports them lost), replaces them and they restore from
    # storage.
    resumed = run(tmp_path, mark, "--resume", str(run_dir), timeout=360)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    after = _events(run_dir)
    first = next(i for i, e in enumerate(after) if e["kind"] == "master_resumed")
    kinds = [e["kind"] for e in after[first:]]
    assert kinds.count("node_replaced") == 2
    assert "node_reattached" not in kinds
    assert kinds[-1] == "job_finished"
    # The fault that restarted the job counts the steps redone from storage against the last
    # step the master before knew of (the timeline's last samples); the workers trained on
    # unheard through the grace, so it is a lower bound, and says so.
    summary = read_summary(run_dir)
    assert summary is not None
    (restarting,) = [f for f in summary.faults if f.restart_round is not None]
    assert restarting.kind == "node_lost" and restarting.restored_from.startswith("storage")
    assert restarting.last_step >= known[restarting.node] >= 0
    (row,) = [r for r in fault_rows(summary) if r[2] == restarting.detail]
    if restarting.first_step_after is None:
        # Training ran to its end within the grace: the restored step was the last, and the
        # restarted round had no step to redo.
        assert row[-1] == "-"
        return
    assert restarting.steps_lost == max(0, restarting.last_step - restarting.first_step_after + 1)
    assert row[-1] == f"at least {restarting.steps_lost}"


def test_resume_refuses_a_run_that_ended_or_is_not_one(tmp_path, mark):
    config = _config(tmp_path, "5s")
    done = run(tmp_path, mark, str(config), "--", sys.executable, "-c", "pass")
    assert done.returncode == 0, done.stdout[-2000:]
    (run_dir,) = (p.parent for p in tmp_path.glob("planaria-runs/*/master.db"))
    again = run(tmp_path, mark, "--resume", str(run_dir))
    assert again.returncode == 2
    assert "has ended (succeeded" in again.stdout + again.stderr
    nothing = run(tmp_path, mark, "--resume", str(tmp_path))
    assert nothing.returncode == 2
    assert "holds no master journal" in nothing.stdout + nothing.stderr


def test_a_second_master_on_a_live_run_is_refused(tmp_path, mark):
    proc = start(tmp_path, mark, str(_config(tmp_path, "10s")))
    try:
        run_dir = _run_dir(tmp_path)
        _wait_step(run_dir, 2)
        second = run(tmp_path, mark, "--resume", str(run_dir))
        assert second.returncode == 2
        assert "is still running the job" in second.stdout + second.stderr
        # Refused before it wrote anything: the live job's timeline tells no resume.
        assert [e for e in _events(run_dir) if e["kind"] == "master_resumed"] == []
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- what a resume refuses before it writes anything ------------------------------------------


def _ended_run(tmp_path: Path, mark: str) -> Path:
    """The run directory of a job that ran to its end in a moment."""
    done = run(tmp_path, mark, str(_config(tmp_path, "5s")), "--", sys.executable, "-c", "pass")
    assert done.returncode == 0, done.stdout[-2000:]
    (run_dir,) = (p.parent for p in tmp_path.glob("planaria-runs/*/master.db"))
    return run_dir


def _journal(run_dir: Path, *statements: tuple[str, tuple[object, ...]]) -> None:
    db = sqlite3.connect(run_dir / "master.db")
    try:
        with db:
            for sql, args in statements:
                db.execute(sql, args)
    finally:
        db.close()


def _as_if_its_master_died(run_dir: Path) -> None:
    """The journal of an ended job, set back to a job still running (its master gone)."""
    db = sqlite3.connect(run_dir / "master.db")
    try:
        (value,) = db.execute("SELECT value FROM parts WHERE key = 'job'").fetchone()
        job = {**json.loads(value), "state": "running", "reason": ""}
        with db:
            db.execute("UPDATE parts SET value = ? WHERE key = 'job'", (json.dumps(job),))
    finally:
        db.close()
    for ended in run_dir.glob("job.ended-*"):  # its end never came: no end mark
        ended.rename(run_dir / "job.running")


def _untouched(run_dir: Path) -> dict[str, bytes]:
    """The run directory's files (its master lock aside: it holds the pid of the last taker)."""
    return {
        p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != "master.lock"
    }


def _refused(tmp_path: Path, mark: str, run_dir: Path) -> str:
    before = _untouched(run_dir)
    resumed = run(tmp_path, mark, "--resume", str(run_dir))
    said = resumed.stdout + resumed.stderr
    assert resumed.returncode == 2, said[-3000:]
    assert "Traceback" not in said
    after = _untouched(run_dir)
    assert after == before, "a refused resume wrote in the run directory"
    return " ".join(said.split())


@pytest.mark.parametrize("target", [".", "master.db", "master.db-wal", "token"])
@pytest.mark.parametrize("bits", [0o020, 0o002])
def test_resume_refuses_a_run_dir_others_can_write(tmp_path, mark, target, bits):
    run_dir = _ended_run(tmp_path, mark)
    _as_if_its_master_died(run_dir)
    path = run_dir / target
    if not path.exists():  # the WAL, gone with the master that closed it: as a killed one left it
        path.touch(mode=0o600)
    path.chmod(path.stat().st_mode & 0o777 | bits)
    said = _refused(tmp_path, mark, run_dir)
    who = "group" if bits == 0o020 else "others"
    assert f"{path if target != '.' else run_dir} is writable by {who}" in said
    assert "refusing to resume" in said


@pytest.mark.parametrize("target", [".", "master.db", "token"])
def test_resume_refuses_a_run_dir_of_another_user(tmp_path, mark, target):
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user takes root")
    run_dir = _ended_run(tmp_path, mark)
    _as_if_its_master_died(run_dir)
    path = run_dir if target == "." else run_dir / target
    os.chown(path, 65534, 65534)  # nobody
    said = _refused(tmp_path, mark, run_dir)
    assert f"{path} is owned by uid 65534" in said
    assert "not by this user (uid 0" in said


def test_resume_refuses_a_symbolic_link_for_a_token(tmp_path, mark):
    run_dir = _ended_run(tmp_path, mark)
    _as_if_its_master_died(run_dir)
    elsewhere = tmp_path / "token"
    (run_dir / "token").rename(elsewhere)
    (run_dir / "token").symlink_to(elsewhere)
    said = _refused(tmp_path, mark, run_dir)
    assert f"{run_dir / 'token'} is a symbolic link" in said


@pytest.mark.parametrize(
    ("damage", "told"),
    [
        ("no rounds", "is damaged: it has no 'rounds' part"),
        ("bogus state", "is damaged: part 'job': 'bogus' is not a valid JobState"),
        ("bad node", "is damaged: node 'node-0': 'lurking' is not a valid NodePhase"),
        ("no token", "cannot read the job's token {run_dir}/token: No such file or directory"),
    ],
)
def test_a_damaged_journal_is_a_clear_error_not_a_traceback(tmp_path, mark, damage, told):
    run_dir = _ended_run(tmp_path, mark)
    _as_if_its_master_died(run_dir)
    if damage == "no rounds":
        _journal(run_dir, ("DELETE FROM parts WHERE key = 'rounds'", ()))
    elif damage == "bogus state":
        job = json.dumps({"state": "bogus", "reason": ""})
        _journal(run_dir, ("UPDATE parts SET value = ? WHERE key = 'job'", (job,)))
    elif damage == "bad node":
        node = json.dumps({"node_id": "node-0", "host": "h", "phase": "lurking"})
        _journal(run_dir, ("UPDATE nodes SET value = ? WHERE node_id = 'node-0'", (node,)))
    else:
        (run_dir / "token").unlink()
    said = _refused(tmp_path, mark, run_dir)
    assert told.format(run_dir=run_dir) in said
    if damage != "no token":
        assert f"the master journal {run_dir / 'master.db'}" in said
