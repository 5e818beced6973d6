"""A long timeline costs status nothing and report a bounded memory; a thousand faults make a
page and a summary of bounded size (benchmarks/events_scale.py measures the figures)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

from planaria import rundir
from planaria.cli.follow import print_summary
from planaria.cli.output import out
from planaria.master.summary import read_summary
from planaria.master.tables import FIRST_FAULTS, LAST_FAULTS, fault_rows
from planaria.report.course import FIRST_EVENTS, INCIDENTS, LAST_EVENTS, POINTS, ROUNDS, course

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("events_scale", ROOT / "benchmarks/events_scale.py")
assert SPEC is not None and SPEC.loader is not None
events_scale = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(events_scale)

PLANARIA = str(Path(sys.executable).parent / "planaria")
PAGE_BOUND = 1_000_000
"""Bytes a report page stays under, whatever its run: one of 1000 faults on 4 nodes makes
~720 kB (it made 13 MB when every fault was drawn and listed)."""


def peak_mb(*command: str) -> float:
    """Peak RSS (MB) of ``command``, run to its end (it must succeed): its ``VmHWM``, read as
    it runs. Not ``wait4``'s ``ru_maxrss``: that keeps the high-water mark of the memory the
    child had before its ``exec``, which a spawn from a large test process (a vfork) shares
    with it, so it would measure this test run, not the command."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    peak = 0
    while proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            break
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                peak = max(peak, int(line.split()[1]))
        time.sleep(0.005)
    assert proc.wait() == 0, command
    return peak / 1024


def test_status_of_a_long_timeline_reads_only_its_end(tmp_path):
    small, large = tmp_path / "small", tmp_path / "large"
    events_scale.write_run(small, 1, nodes=8)
    events_scale.write_run(large, 150, nodes=8)
    assert (large / rundir.EVENTS_FILE).stat().st_size > 100e6
    before = peak_mb(PLANARIA, "status", str(small))
    started = time.monotonic()
    after = peak_mb(PLANARIA, "status", str(large))
    took = time.monotonic() - started
    # Reading the whole (as status did) took ~2 GB and ~13 s here; the end: as little as
    # for a timeline of 1 MB.
    assert after < before + 30, (before, after)
    assert took < 8, took


def test_a_course_keeps_bounded_aggregates_of_any_timeline(tmp_path):
    run = tmp_path / "run"
    events_scale.write_run(run, 8, nodes=4, faults=1000)
    told = course(rundir.read_events(run), rundir.summary(run))
    assert told.faults == 1000
    assert told.fault_kinds == {"worker_failed (transient)": 1000}
    assert [i.number for i in told.incidents] == list(range(1001 - INCIDENTS, 1001))
    assert all(i.recovered is not None and i.restore for i in told.incidents)
    assert len(told.rounds) == ROUNDS and told.rounds_left_out == 1001 - ROUNDS
    for lines in told.nodes.values():
        assert POINTS // 2 <= sum(map(len, lines)) <= POINTS + 1
    assert len(told.checkpoints) <= POINTS + 1
    assert len(told.events) == FIRST_EVENTS + LAST_EVENTS
    assert told.events[-1].message == "job succeeded" and told.events_left_out > 0
    assert told.start == told.events[0].time
    assert told.outcome is not None and told.outcome.time == pytest.approx(told.end)


def test_a_thousand_faults_make_a_page_and_a_summary_of_bounded_size(tmp_path):
    run = tmp_path / "run"
    events_scale.write_run(run, 3, nodes=4, faults=1000)
    page = run / "page.html"
    assert peak_mb(PLANARIA, "report", str(run), "-o", str(page)) < 400
    html = page.read_text()
    assert len(html.encode()) < PAGE_BOUND, len(html)
    assert "The last 50 of 1000 faults (1000 worker_failed (transient))" in html
    assert "<td>worker_failed (transient)</td><td>1000</td><td>1000</td>" in html

    summary = read_summary(run)
    assert summary is not None and len(summary.faults) == 1000
    rows = fault_rows(summary)
    assert len(rows) == FIRST_FAULTS + 1 + LAST_FAULTS
    between = 1000 - FIRST_FAULTS - LAST_FAULTS
    assert (
        rows[FIRST_FAULTS][2] == f"... {between} more faults: {between} worker_failed (transient)"
    )
    with out.capture() as printed:
        print_summary(summary, run)
    assert len(printed.get().splitlines()) < 80
