"""``planaria report`` on the run directory of a real job through a worker kill and a node kill:
the page tells both faults, their detection, restore and recovery with the figures
``planaria run`` printed, it loads nothing from the network, the picture is a PNG, and a
damaged line of the timeline is skipped with a warning."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import uuid
from html import escape
from pathlib import Path

import pytest

from planaria import rundir
from planaria.report import course, plot
from planaria.testing.jobs import job, run, wait_gone
from support.report_layout import narrowest_axes, overlapping, text_outside

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

CHAOS = [
    {"kind": "kill_worker", "rank": 1, "at_step": 6},
    {"kind": "kill_node", "node_rank": 1, "at_step": 17, "attempt": 1},
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One real 2-node job through a worker kill and a node kill: (its run dir, its output)."""
    where = tmp_path_factory.mktemp("faulty")
    mark = uuid.uuid4().hex
    try:
        # Room for more restarts than the two faults need: on a busy machine a round's
        # rendezvous port may be taken before its store listens (EADDRINUSE), one more fault.
        config = job(where, chaos=CHAOS, job={"max_restarts": 6})
        result = run(where, mark, str(config))
    finally:
        left = wait_gone(mark, grace=5)
    assert left == [], f"processes of the job survived it: {left}"
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = where.glob("planaria-runs/*")
    return run_dir, result.stdout


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "planaria"), "report", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow  # the job they share takes ~30 s
def test_every_run_writes_a_report_telling_both_faults_and_their_recoveries(faulty_run):
    run_dir, output = faulty_run
    page = run_dir / "report.html"
    assert f"report: {page}" in output
    html = page.read_text()
    assert html.count("<svg") == 1 and "</svg>" in html
    assert "<h2>Nodes</h2>" not in html  # no topology labels: no table of them

    summary = json.loads((run_dir / "summary.json").read_text())
    faults = summary["faults"]
    kinds = [f["kind"] for f in faults]
    # The node kill may bring a peer's failure too (as in test_run): the kill's own faults
    # are the first worker failure and the node loss.
    assert kinds[0] == "worker_failed" and "node_lost" in kinds
    for fault in faults:
        # The faults table: the very figures `planaria run` printed.
        assert fault["detail"] in html and (fault["restored_from"] or "-") in html
        if fault["recovered_at"] is not None:
            recovery = f"{fault['recovered_at'] - fault['time']:.2f}s"
            assert recovery in html and recovery in output
    assert faults[0]["restored_from"].startswith("memory") and faults[0]["recovered_at"]
    lost = faults[kinds.index("node_lost")]
    assert re.fullmatch(r"storage \(step \d+\)", lost["restored_from"]), lost
    goodput = re.search(r"goodput\s*│\s*([\d.]+%: [^│]*?)\s*│", output)
    assert goodput and f"<td>{escape(goodput.group(1))}</td>" in html  # with its definition
    assert "start-up and recovery count against it" in goodput.group(1)

    # Each fault from the timeline: detected, restarted, restored, recovered.
    told = course(rundir.events(run_dir), rundir.summary(run_dir))
    first, *_ = told.incidents
    (second,) = [i for i in told.incidents if i.kind == "node_lost"]
    assert (first.kind, first.where) == ("worker_failed", f"rank 1 on {faults[0]['node']}")
    assert second.where == lost["node"]
    assert second.injected is not None and second.injected <= second.detected
    assert second.replaced_by == "node-2"
    for incident in (first, second):
        assert incident.restarted is not None and incident.restored is not None
        assert incident.detected <= incident.restarted <= incident.restored
        assert f"{incident.detected:.2f}s" in html
    assert first.restore is not None and first.restore.startswith("memory:")
    assert second.restore == "storage"
    # Both recovered: the node loss in its own round, or in a later one's (when a peer's
    # failure in the round without it came too).
    assert first.recovered is not None and f"{first.recovered:.2f}s" in html
    recovered = [i.recovered for i in told.incidents[told.incidents.index(second) :]]
    assert any(at is not None and f"{at:.2f}s" in html for at in recovered)
    assert "recovered from worker_failed" in html
    assert told.incidents[-1].recovered is not None
    # The nodes' steps were sampled, node-2 trained in the last round.
    assert {"node-0", "node-1", "node-2"} <= set(told.nodes)
    (survivor,) = {"node-0", "node-1"} - {second.where}
    assert told.rounds[-1].ranks == {survivor: 0, "node-2": 1}
    assert told.outcome is not None and "succeeded" in told.outcome.label


@pytest.mark.slow  # the job they share takes ~30 s
def test_the_report_draws_the_losses_the_script_printed_a_line_a_round(faulty_run):
    """The example reports each loss it prints (``monitor.step(step, loss=...)`` through
    ``Checkpointer.save``): the report's loss series is those very values, at their steps, a
    line for each round it sampled, and the page lists them. A step done again after a restore
    prints the same loss (the training is deterministic)."""
    run_dir, output = faulty_run
    printed: dict[int, set[str]] = {}
    for step, loss in re.findall(r"^\[rank0\]:\s*step (\d+) loss ([\d.]+) ", output, re.M):
        printed.setdefault(int(step), set()).add(loss)
    assert len(printed) >= 20 and all(len(v) == 1 for v in printed.values()), printed
    told = course(rundir.events(run_dir), rundir.summary(run_dir))
    points = [p for line in told.losses for p in line]
    # One point a heartbeat at most, and this job's rounds last a few seconds each: a round
    # cut (or ended) within a heartbeat may have no point at all, so only one is certain.
    assert points, told.losses
    for point in points:
        assert {f"{point.loss:.4f}"} == printed[point.step], (point, printed[point.step])
    starts = [r.start for r in told.rounds if r.number > 1]
    assert len(starts) >= 2
    for line in told.losses:  # no line crosses a round's start
        assert not any(line[0].time < start <= line[-1].time for start in starts), line
    fig = plot.figure(told)
    (chart,) = [ax for ax in fig.axes if ax.get_ylabel() == "loss"]
    dashed = [line.get_xdata()[0] for line in chart.get_lines() if line.get_linestyle() == "--"]
    assert dashed == starts
    html = (run_dir / "report.html").read_text()
    assert "<h2>Training loss</h2>" in html
    assert f"<td>{points[-1].step}</td><td>{points[-1].loss:.6g}</td>" in html


STEP_TOKENS = 8 * 32 * 4
"""The tokens the example reports a step: 8 sequences of 32 tokens on each of 4 ranks."""


@pytest.mark.slow  # the job they share takes ~30 s
def test_the_report_draws_the_tokens_per_second_the_script_reported(faulty_run):
    """The example reports each step's tokens (``Checkpointer.save(..., tokens=...)``): rank
    0's node's samples carry the job's count, which only grows (in whole steps) through both
    faults, a line a round; the throughput is tokens/s wherever a round has two samples; the
    summary ``planaria run`` printed and the page state the tokens and their mean rate."""
    run_dir, output = faulty_run
    told = course(rundir.events(run_dir), rundir.summary(run_dir))
    points = [p for line in told.tokens for p in line]
    assert points, told.tokens
    totals = [p.tokens for p in points]
    assert totals == sorted(totals) and all(t > 0 and t % STEP_TOKENS == 0 for t in totals)
    rounds = {r.number for r in told.rounds}
    assert len(told.tokens) <= len(rounds)
    fig = plot.figure(told)
    rated = any(line[-1].time > line[0].time for line in told.tokens)
    assert fig.axes[-1].get_ylabel() == ("tokens/s" if rated else "steps/s")
    summary = json.loads((run_dir / "summary.json").read_text())
    tokens = summary["tokens"]
    assert tokens >= totals[-1] and tokens % STEP_TOKENS == 0
    printed = re.search(
        r"tokens\s*│\s*([^│]*?tokens/s mean over [\d.]+s of training[^│]*?)\s*│", output
    )
    assert printed and f"({tokens:,.0f})" in printed.group(1), output[-3000:]
    html = (run_dir / "report.html").read_text()
    assert f"<td>{escape(printed.group(1))}</td>" in html


@pytest.mark.slow  # the job they share takes ~30 s
def test_the_page_needs_no_network(faulty_run):
    html = (faulty_run[0] / "report.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.I)
    assert not re.search(r"<script[^>]*\bsrc\b", html, re.I)
    assert not re.search(r"@import|url\(\s*['\"]?(https?:)?//", html, re.I)
    assert "<link" not in html.lower()


@pytest.mark.slow  # the job they share takes ~30 s
def test_the_command_writes_the_page_and_a_png_where_asked(faulty_run, tmp_path):
    run_dir, _ = faulty_run
    page, picture = tmp_path / "job.html", tmp_path / "job.png"
    result = report(str(run_dir), "--output", str(page), "--png", str(picture))
    assert result.returncode == 0, result.stderr
    assert f"report: {page}" in result.stdout
    data = picture.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 800 and height > 600
    assert "node_lost" in page.read_text()


@pytest.mark.slow  # the job they share takes ~30 s
def test_a_damaged_line_is_skipped_with_a_warning_naming_the_file_and_line(faulty_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(faulty_run[0], copy)
    timeline = copy / "events.jsonl"
    lines = timeline.read_text().splitlines()
    lines[2] = lines[2][: len(lines[2]) // 2]  # a line cut short
    lines[4] = json.dumps({"kind": "no_such_kind", "job": "x", "time": 1.0})
    timeline.write_text("\n".join(lines) + "\n")
    (copy / "report.html").unlink()
    result = report(str(copy))
    assert result.returncode == 0, result.stderr
    said = " ".join(result.stderr.split())
    assert f"{timeline}, line 3: not JSON" in said
    assert f"{timeline}, line 5: not a job event (kind:" in said
    assert "Traceback" not in result.stderr
    assert "node_lost" in (copy / "report.html").read_text()


def test_a_directory_that_is_no_run_is_an_error(tmp_path):
    result = report(str(tmp_path))
    assert result.returncode == 2
    assert "is not a planaria run directory" in result.stderr
    result = report(str(tmp_path / "missing"))
    assert result.returncode == 2 and "does not exist" in result.stderr


CRASH = "import sys, time; time.sleep(0.3); print('boom', file=sys.stderr); sys.exit(3)"


@pytest.fixture(scope="module")
def crash_loop_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real job whose every worker fails before any step: stopped as a crash loop, with
    a reason a paragraph long."""
    where = tmp_path_factory.mktemp("crashloop")
    mark = uuid.uuid4().hex
    try:
        config = job(where, job={"command": [sys.executable, "-c", CRASH], "max_restarts": 4})
        result = run(where, mark, str(config))
    finally:
        left = wait_gone(mark, grace=5)
    assert left == [], f"processes of the job survived it: {left}"
    assert result.returncode == 1, result.stdout + result.stderr
    assert "crash loop" in result.stdout
    (run_dir,) = where.glob("planaria-runs/*")
    return run_dir


def test_a_failed_runs_picture_keeps_its_text_inside_and_its_charts_wide(crash_loop_run):
    """The end reason is written in full below the chart, not across a lane; no label runs
    off the picture or over another; and the charts keep the figure's width (a long label
    squeezed them)."""
    told = course(rundir.events(crash_loop_run), rundir.summary(crash_loop_run))
    assert told.outcome is not None and "crash loop" in told.outcome.label
    assert len(told.incidents) >= 2 and told.incidents[-1].recovered is None
    fig = plot.figure(told)
    assert text_outside(fig) == []
    assert overlapping(fig) == []
    assert narrowest_axes(fig) > 0.8
    # The whole reason is in the picture, wrapped, and on the page.
    reason = " ".join(fig._supxlabel.get_text().split())
    assert reason == f"end: {told.outcome.label}"
    html = (crash_loop_run / "report.html").read_text()
    assert escape(told.outcome.label.split(";")[0]) in html


@pytest.mark.slow  # the job they share takes ~30 s
def test_a_recovered_runs_picture_keeps_its_text_inside_and_shows_its_rate(faulty_run):
    run_dir, _ = faulty_run
    told = course(rundir.events(run_dir), rundir.summary(run_dir))
    fig = plot.figure(told)
    assert text_outside(fig) == []
    assert overlapping(fig) == []
    # Its throughput on the step chart's right axis, tokens per second (the example reports
    # its tokens; steps per second where no round has two samples of them): over time they
    # add up to the tokens each round's line counts (the steps each line of the job's step
    # shows).
    (rate,) = [ax for ax in fig.axes if ax.get_ylabel() in ("tokens/s", "steps/s")]
    done = 0.0
    for line in rate.get_lines():
        x, y = list(line.get_xdata()), list(line.get_ydata())
        assert min(y) >= 0 and all(x[i] < x[i + 1] for i in range(0, len(x), 2))
        done += sum((x[i + 1] - x[i]) * y[i] for i in range(0, len(x), 2))
    if rate.get_ylabel() == "tokens/s":
        shown = sum(line[-1].tokens - line[0].tokens for line in told.tokens if len(line) > 1)
    else:
        shown = sum(line[-1].step - line[0].step for line in told.job_steps if len(line) > 1)
    assert shown > 0 and done == pytest.approx(shown)
    assert narrowest_axes(fig) > 0.8
