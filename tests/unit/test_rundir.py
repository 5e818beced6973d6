"""Reading a run's timeline back: a damaged line is skipped with a warning naming the file and
the line, the rest is read; the end of a timeline is read backwards, block by block, and
finds what a reading of the whole finds."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from planaria import rundir
from planaria.events import EventKind, JobEvent, NodeFenced

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("events_scale", ROOT / "benchmarks/events_scale.py")
assert SPEC is not None and SPEC.loader is not None
events_scale = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(events_scale)


def planaria(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "planaria"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def cut(timeline: Path, number: int) -> None:
    """Cut line ``number`` (from 1; -1 the last) short, as a crash mid-write does."""
    lines = timeline.read_text().splitlines(keepends=True)
    index = number - 1 if number > 0 else len(lines) + number
    lines[index] = lines[index][: len(lines[index]) // 2]
    if index < len(lines) - 1:
        lines[index] += "\n"
    timeline.write_text("".join(lines))


def test_a_damaged_line_is_skipped_with_a_warning_and_the_rest_is_read(tmp_path):
    run = tmp_path / "run"
    events_scale.write_run(run, 0.2, nodes=2, faults=2)
    timeline = run / rundir.EVENTS_FILE
    whole = rundir.events(run)
    cut(timeline, 3)
    lines = timeline.read_text().splitlines()
    lines[5] = json.dumps({"kind": "no_such_kind", "job": "x", "time": 1.0})
    timeline.write_text("\n".join(lines) + "\n")

    result = planaria("report", str(run))
    assert result.returncode == 0, result.stderr
    said = " ".join(result.stderr.split())
    assert f"{timeline}, line 3: not JSON" in said
    assert f"{timeline}, line 6: not a job event (kind:" in said
    assert "Traceback" not in result.stderr
    assert len(rundir.events(run)) == len(whole) - 2
    assert "job succeeded" in (run / "report.html").read_text()


def test_status_shows_a_timeline_whose_last_line_is_partial(tmp_path):
    run = tmp_path / "run"
    events_scale.write_run(run, 0.2, nodes=2, faults=2)
    timeline = run / rundir.EVENTS_FILE
    cut(timeline, -1)  # the job_finished line, its newline and half of it gone
    result = planaria("status", str(run), "--json")
    assert result.returncode == 0, result.stderr
    assert f"{timeline}, line 1 from its end: not JSON" in " ".join(result.stderr.split())
    shown = json.loads(result.stdout)
    assert shown["state"] == "succeeded" and len(shown["events"]) == 10
    assert all(n["step"] > 0 for n in shown["nodes"])


@pytest.mark.parametrize("faults", [0, 7])
def test_the_end_read_backwards_is_the_end_of_the_whole(tmp_path, monkeypatch, faults):
    run = tmp_path / "run"
    events_scale.write_run(run, 1.5, nodes=3, faults=faults)
    monkeypatch.setattr(rundir, "BLOCK", 4096)  # many block boundaries, lines across them
    whole = rundir.events(run)
    told = [e for e in whole if e.kind is not EventKind.PROGRESS]
    last = {e.node: e.step for e in whole if e.kind is EventKind.PROGRESS}
    for count in (0, 1, 10, 25, len(told), len(told) + 5):
        tail = rundir.tail(run, count, nodes=["node-0", "node-2", "node-9"])
        assert tail.events == told[len(told) - min(count, len(told)) :]
        assert tail.steps == {"node-0": last["node-0"], "node-2": last["node-2"]}


def test_an_event_far_back_is_found_past_blocks_of_step_samples(tmp_path, monkeypatch):
    """The worst case: nothing but step samples after the job's first events."""
    run = tmp_path / "run"
    events_scale.write_run(run, 1.0, nodes=2, faults=0)
    timeline = run / rundir.EVENTS_FILE
    lines = timeline.read_text().splitlines()
    kept = [line for line in lines if line.startswith('{"kind":"progress"')]
    timeline.write_text("\n".join([*lines[:2], *kept]) + "\n")
    monkeypatch.setattr(rundir, "BLOCK", 4096)
    tail = rundir.tail(run, 10, nodes=["node-1"])
    assert [e.kind for e in tail.events] == [
        EventKind.JOB_STARTED,
        EventKind.RENDEZVOUS_COMPLETED,
    ]
    assert tail.steps["node-1"] > 0
    monkeypatch.setattr(rundir, "EVENTS_WITHIN", 64 << 10)  # not that far back
    tail = rundir.tail(run, 10, nodes=["node-1"])
    assert tail.events == [] and tail.steps["node-1"] > 0


def test_a_line_too_long_to_be_an_event_is_skipped_unheld(tmp_path, monkeypatch):
    """A damaged file without newlines costs no more memory than one line's limit."""
    run = tmp_path / "run"
    events_scale.write_run(run, 0.5, nodes=2, faults=1)
    timeline = run / rundir.EVENTS_FILE
    whole = rundir.events(run)
    lines = timeline.read_bytes().splitlines(keepends=True)
    event = JobEvent.of(NodeFenced(request="heartbeat"), job="bench", message="x" * 300_000)
    long = event.model_dump_json().encode() + b"\n"  # an event, but longer than any is
    for at in (len(lines) - 3, 40, 0):  # near the end, in the middle, first
        lines.insert(at, long)
    timeline.write_bytes(b"".join(lines))
    monkeypatch.setattr(rundir, "LONGEST", 100_000)
    monkeypatch.setattr(rundir, "BLOCK", 4096)
    assert rundir.events(run) == whole
    told = [e for e in whole if e.kind is not EventKind.PROGRESS]
    assert rundir.tail(run, len(told) + 1).events == told
    assert rundir.tail(run, 2).events == told[-2:]
