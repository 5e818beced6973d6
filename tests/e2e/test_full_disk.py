"""A full disk at the end of a job: workers flooding their logs fill the run directory's file
system, the training ends well all the same. The job is recorded as finished (the end mark,
the journal's last write in the reserve's room), ``planaria run`` exits 0 with its summary,
``planaria status`` says it succeeded, and ``--resume`` refuses to train it again.

A real full file system: a small tmpfs mounted as the job's workdir (root only).
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from planaria import events
from planaria.master.journal import (
    RESERVE,
    RESERVE_BYTES,
    Journal,
    ended_mark,
    mark_ended,
)
from planaria.master.timeline import Timeline
from planaria.testing.jobs import job, run

SIZE_MB = 24

FLOOD = textwrap.dedent(
    """
    import os
    line = b"x" * 4095 + b"\\n"
    for _ in range({count}):  # twice the file system: it fills, the rest is refused
        try:
            os.write(1, line)
        except OSError:
            pass
    """
)


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A tmpfs of SIZE_MB MiB, unmounted after the test."""
    yield from _tmpfs(f"size={SIZE_MB}m")


@pytest.fixture
def tiny_disk() -> Iterator[Path]:
    """A tmpfs of 4 MiB with 12 inodes, unmounted after the test."""
    yield from _tmpfs("size=4m,nr_inodes=12")


def _tmpfs(options: str) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    where = Path(tempfile.mkdtemp(prefix="planaria-full-disk-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"{options},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        where.rmdir()


def test_a_job_that_finished_on_a_full_disk_is_finished_and_never_rerun(
    tmp_path: Path,
    small_disk: Path,
    mark: str,
) -> None:
    count = SIZE_MB * 2 * 256  # 4 KiB lines: twice the disk
    flood = tmp_path / "flood.py"
    flood.write_text(FLOOD.format(count=count))
    config = job(
        tmp_path,
        job={
            "command": [sys.executable, str(flood)],
            "nodes": 1,
            "procs_per_node": 2,
            "max_restarts": 0,
            "workdir": str(small_disk),
        },
        master={"heartbeat_interval": "0.5s", "heartbeat_timeout": "15s", "grace": "5s"},
    )
    done = run(tmp_path, mark, str(config))
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    assert "succeeded" in done.stdout, done.stdout[-3000:]
    (run_dir,) = (p.parent for p in small_disk.glob("planaria-runs/*/master.db"))
    free = os.statvfs(run_dir)
    assert free.f_bavail * free.f_frsize <= RESERVE_BYTES + (1 << 20)  # full, but the reserve
    print(done.stdout[-3000:])

    status = subprocess.run(
        [str(Path(sys.executable).parent / "planaria"), "status", str(run_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stdout + status.stderr
    assert '"state": "succeeded"' in status.stdout, status.stdout
    assert "--resume" not in status.stdout

    again = run(tmp_path, mark, "--resume", str(run_dir))
    assert again.returncode == 2, (again.stdout + again.stderr)[-3000:]
    assert "nothing to resume" in again.stdout + again.stderr


def _fill(path: Path) -> None:
    """Write ``path`` until the file system holds no more."""
    with open(path, "ab", buffering=0) as f:
        try:
            while True:
                f.write(bytes(1 << 16))
        except OSError:
            pass
        try:
            while True:
                f.write(b"x")
        except OSError:
            pass


def test_on_a_full_disk_the_end_is_recorded_and_nothing_raises(tiny_disk: Path) -> None:
    journal = Journal.create(tiny_disk, {"config": {}})
    timeline = Timeline(tiny_disk / "events.jsonl", "job", lambda event: None)
    timeline.emit(events.JobFinished(), "a line that fits")
    _fill(tiny_disk / "flood")
    with pytest.raises(sqlite3.OperationalError, match="full"):
        journal.write({"job": {"state": "running", "pad": "x" * 20000}}, {})
    # The job's last state: in the reserve's room, with what the failed write held.
    assert journal.write({"job": {"state": "succeeded", "pad": "x" * 20000}}, {}, last=True)
    assert not (tiny_disk / RESERVE).exists()
    journal.close()
    _fill(tiny_disk / "flood")
    while True:  # and no inode left either
        try:
            (tiny_disk / f"inode-{len(os.listdir(tiny_disk))}").touch()
        except OSError:
            break
    mark_ended(tiny_disk, "succeeded")
    assert ended_mark(tiny_disk) == "succeeded"
    before = (tiny_disk / "events.jsonl").read_bytes()
    timeline.emit(events.JobFinished(), "y" * 10000)  # no room: counted, nothing half-written
    timeline.close()
    assert timeline.unwritten == 1 and "space" in timeline.write_error
    assert (tiny_disk / "events.jsonl").read_bytes() == before
    for filler in [tiny_disk / "flood", *tiny_disk.glob("inode-*")]:
        filler.unlink()  # SQLite needs room to open a WAL journal, even to read it
    reopened, journalled = Journal.open(tiny_disk)
    reopened.close()
    assert journalled.parts["job"]["state"] == "succeeded"
