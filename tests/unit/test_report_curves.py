"""The training loss and the tokens from ``planaria.monitor.step`` to the report: the worker's
slot, the heartbeat's view of it, the timeline's samples, the job's count of tokens round after
round, the curves (tokens/s or steps/s) and their round starts; and the time axis of a job over
an hour in the time of day. Synthetic events where a real job would take hours
(``test_report.py`` draws a real job's loss and tokens/s)."""

from __future__ import annotations

import datetime
import itertools
import json
import math
import re
import warnings
from pathlib import Path

import pytest

from planaria import events, monitor, rundir
from planaria.diagnosis.messages import DiagnosisSpec
from planaria.diagnosis.watch import NodeWatch
from planaria.events import JobEvent
from planaria.master.summary import Summary
from planaria.master.timeline import last_tokens
from planaria.master.tokens import TokenCount
from planaria.progress import ProgressBoard
from planaria.report import plot
from planaria.report.course import course
from planaria.report.page import page
from support.report_layout import narrowest_axes, overlapping, text_outside

T0 = 1_800_000_000.0
STEP_TOKENS = 65536
"""The tokens of a step in the synthetic timelines: tokens/s in the thousands."""


@pytest.fixture
def board(tmp_path, monkeypatch):
    """A progress board of two slots this process writes as local rank 0."""
    board = ProgressBoard(tmp_path / "board", 2)
    monkeypatch.setenv("PLANARIA_PROGRESS_FILE", str(board.path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("PLANARIA_CHAOS", raising=False)
    monkeypatch.setattr(monitor, "_pid", None)  # map this board's slot at the next step
    monkeypatch.setattr(monitor, "_warned", False)
    yield board
    board.close()
    monkeypatch.setattr(monitor, "_pid", None)


def test_a_steps_loss_stays_in_the_slot_until_the_next_and_the_heartbeat_carries_it(board):
    monitor.step(0)
    assert (board.read(0).loss, board.read(0).loss_step) == (None, -1)
    monitor.step(1, loss=2.5)
    monitor.step(2)  # no loss this step: the last one stays, with its step
    slot = board.read(0)
    assert (slot.step, slot.loss, slot.loss_step) == (2, 2.5, 1)
    monitor.step(3, loss=7)  # an int is a number too
    watch = NodeWatch(DiagnosisSpec(), "node-0", 1, 0, 0.0)
    mine, other = watch.progress(board.read_all())
    assert (mine.step, mine.loss, mine.loss_step) == (3, 7.0, 3)
    assert (other.step, other.loss, other.loss_step) == (-1, None, -1)
    board.reset()  # a new round: no loss until a worker reports one
    assert board.read(0).loss is None


@pytest.mark.parametrize(
    ("loss", "named"), [("0.5", "str"), (True, "bool"), ([0.5], "list"), (object(), "object")]
)
def test_a_loss_that_is_no_number_is_an_error_at_the_call_naming_it(board, loss, named):
    with pytest.raises(TypeError, match=rf"monitor.step\(4, loss=...\).* not {named}$"):
        monitor.step(4, loss=loss)
    assert board.read(0).step == -1  # nothing was reported


def test_a_tensor_loss_is_an_error_that_says_to_pass_its_item(board):
    class Tensor:  # what matters of a torch tensor: not a number, it has .item()
        def item(self) -> float:
            return 1.0

    with pytest.raises(TypeError, match=r"not Tensor \(pass loss.item\(\)\)"):
        monitor.step(4, loss=Tensor())


def test_a_loss_that_is_not_finite_is_left_out_with_one_warning(board):
    monitor.step(0, loss=3.0)
    with pytest.warns(RuntimeWarning, match=r"loss=nan\): a loss that is not finite is left out"):
        monitor.step(1, loss=math.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # told once: a diverged run does not flood its log
        monitor.step(2, loss=math.inf)
    slot = board.read(0)
    assert (slot.step, slot.loss, slot.loss_step) == (2, 3.0, 0)


def test_a_steps_tokens_are_summed_in_the_slot_and_the_heartbeat_carries_the_sum(board):
    monitor.step(0)
    assert (board.read(0).tokens, board.read(0).tokens_step) == (None, -1)
    monitor.step(1, tokens=4096)
    monitor.step(2)  # none this step: the sum stays, with the last step that had some
    assert (board.read(0).tokens, board.read(0).tokens_step) == (4096.0, 1)
    monitor.step(3, tokens=1000.5, loss=2.0)  # a real number too, beside a loss
    watch = NodeWatch(DiagnosisSpec(), "node-0", 1, 0, 0.0)
    mine, other = watch.progress(board.read_all())
    assert (mine.step, mine.tokens, mine.tokens_step, mine.loss) == (3, 5096.5, 3, 2.0)
    assert (other.tokens, other.tokens_step) == (None, -1)
    board.reset()  # a new round: no tokens until a worker reports some
    assert board.read(0).tokens is None


@pytest.mark.parametrize(
    ("tokens", "error", "says"),
    [
        ("4096", TypeError, "must be a number, not str"),
        (True, TypeError, "must be a number, not bool"),
        ([4096], TypeError, "must be a number, not list"),
        (-1, ValueError, r"-1\): the tokens must be a finite number not below 0"),
        (math.nan, ValueError, r"nan\): the tokens must be a finite"),
        (math.inf, ValueError, r"inf\): the tokens must be a finite"),
        (10**400, ValueError, "the tokens must be a finite"),
    ],
)
def test_tokens_that_are_no_count_are_an_error_at_the_call_naming_the_step(
    board, tokens, error, says
):
    with pytest.raises(error, match=rf"monitor\.step\(4, tokens=.*{says}"):
        monitor.step(4, tokens=tokens)
    assert board.read(0).step == -1  # nothing was reported


def test_a_tensor_of_tokens_is_an_error_that_says_to_pass_a_number(board):
    class Tensor:
        def item(self) -> int:
            return 1

    with pytest.raises(TypeError, match=r"not Tensor \(pass int\(...\) or .item\(\)\)"):
        monitor.step(4, tokens=Tensor())


def test_the_jobs_tokens_add_up_each_rounds_last_sum_and_a_resumed_master_counts_on(tmp_path):
    count = TokenCount()
    assert count.sample(1) is None
    assert count.heard(1, 0.0)  # known from now on, at zero
    assert count.heard(1, 300.0) and not count.heard(1, 300.0)
    assert count.sample(1) == (300.0, 300.0)
    assert count.heard(2, 100.0)  # a new round's workers: their sum from zero
    assert not count.heard(1, 900.0)  # a late heartbeat of round 1: counted then
    assert count.heard(2, 50.0)  # below the round's last sum: a new worker's
    assert (count.total, count.sample(1), count.sample(2)) == (450.0, None, (450.0, 50.0))

    timeline = tmp_path / "events.jsonl"
    lines = [
        _event(1, events.Progress(round=1, tokens=300.0, round_tokens=300.0), node="n", step=3),
        _event(2, events.Progress(round=2, tokens=450.0, round_tokens=150.0), node="n", step=4),
        _event(3, events.Progress(round=2), node="other", step=4),  # another node's
    ]
    timeline.write_text("".join(e.model_dump_json() + "\n" for e in lines) + '{"kind":"prog')
    resumed = last_tokens(timeline)
    assert (resumed.total, resumed.round, resumed.seen) == (450.0, 2, 150.0)
    assert resumed.heard(2, 200.0) and resumed.total == 500.0  # on from the round's sum
    assert last_tokens(tmp_path / "none.jsonl").total is None


def test_a_checkpoint_save_reports_its_loss_and_tokens_and_refuses_wrong_ones_before_saving(
    board, tmp_path, monkeypatch
):
    torch = pytest.importorskip("torch")
    from planaria.checkpoint import Checkpointer

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    state = {"w": torch.arange(4.0)}
    ckpt = Checkpointer(tmp_path / "ckpt")
    try:
        ckpt.save(0, state, persist=False, loss=1.25, tokens=64)
        ckpt.save(1, state, persist=False, blocking=False, tokens=64)
        ckpt.wait_copy()
        slot = board.read(0)
        assert (slot.step, slot.loss, slot.loss_step) == (1, 1.25, 0)
        assert (slot.tokens, slot.tokens_step) == (128.0, 1)
        with pytest.raises(ValueError, match=r"monitor.step\(2, tokens=-64\)"):
            ckpt.save(2, state, persist=False, tokens=-64)
        with pytest.raises(TypeError, match=r"monitor.step\(2, loss=...\).*not Tensor"):
            ckpt.save(2, state, persist=False, loss=torch.tensor(0.5))
        assert board.read(0).step == 1  # refused at the call: nothing saved, nothing reported
        ckpt.save(2, state, persist=False, blocking=False, loss=0.5)
        ckpt.wait_copy()
        assert (board.read(0).loss, board.read(0).loss_step) == (0.5, 2)
    finally:
        ckpt.close()


def _event(at: float, payload: events.Payload, **fields: object) -> JobEvent:
    event = JobEvent.of(payload, job="curves", message=str(payload.KIND.value), **fields)
    return event.model_copy(update={"time": T0 + at})


def _rendezvous(at: float, round_: int) -> JobEvent:
    ranks = {"node-0": 0, "node-1": 1}
    return _event(
        at,
        events.RendezvousCompleted(
            round=round_, ranks=ranks, world_size=4, restore="storage", restore_why="-"
        ),
    )


def _timeline(
    hours: float, losses: bool, restart_at: float | None = None, tokens: bool = False
) -> list[JobEvent]:
    """A job of two nodes over ``hours``: a hundred samples (a minute apart at the least),
    rank 0's loss (and the job's tokens, :data:`STEP_TOKENS` a step, the steps done again
    after the restart counted again) with node-0's, a restart into round 2 at ``restart_at``
    seconds."""
    timeline = [
        _event(0, events.JobStarted(run_id="curves-1", nodes=["node-0", "node-1"])),
        _rendezvous(5, 1),
    ]
    round_, step, span = 1, 0, hours * 3600
    total = in_round = 0.0
    every = max(60, int(span / 100))
    for at in map(float, range(every, int(span), every)):
        if restart_at is not None and round_ == 1 and at >= restart_at:
            round_, step, in_round = 2, step - 20, 0.0
            timeline.append(_rendezvous(at - 30, 2))
        step += 10
        total, in_round = total + 10 * STEP_TOKENS, in_round + 10 * STEP_TOKENS
        loss = 5.0 * math.exp(-step / 400) + 0.2
        for node in ("node-0", "node-1"):
            with_loss = losses and node == "node-0"
            with_tokens = tokens and node == "node-0"
            payload = events.Progress(
                round=round_,
                loss=loss if with_loss else None,
                loss_step=step if with_loss else None,
                tokens=total if with_tokens else None,
                round_tokens=in_round if with_tokens else None,
            )
            timeline.append(_event(at, payload, node=node, step=step))
    timeline.append(_event(span, events.JobFinished(), step=step))
    return timeline


def _written(tmp_path: Path, timeline: list[JobEvent]) -> Path:
    """``timeline`` as a run directory's, read back as ``planaria report`` reads it."""
    run = tmp_path / "run"
    run.mkdir()
    lines = "".join(e.model_dump_json() + "\n" for e in timeline)
    (run / rundir.EVENTS_FILE).write_text(lines)
    return run


def test_the_loss_series_is_rank_0s_one_line_a_round_read_as_the_master_writes_it(tmp_path):
    timeline = _timeline(2, losses=True, restart_at=3600)
    run = _written(tmp_path, timeline)
    samples = list(rundir.read_timeline(run))
    told = course(samples)
    written = [
        (e.data["loss_step"], e.data["loss"]) for e in timeline if e.data.get("loss") is not None
    ]
    got = [(p.step, p.loss) for line in told.losses for p in line]
    assert got == written  # every point: fewer than the thinning's limit
    assert len(told.losses) == 2  # the restart starts a new line
    restart = next(r for r in told.rounds if r.number == 2)
    assert told.losses[0][-1].time < restart.start <= told.losses[1][0].time
    # The fast reader's samples and the events' own reading agree.
    assert course(rundir.parse_line(json.dumps(e.model_dump(mode="json")).encode())
                         for e in timeline).losses == told.losses  # fmt: skip


def test_a_job_that_reported_no_loss_has_no_loss_chart_and_no_word_of_it(tmp_path):
    told = course(_timeline(0.5, losses=False))
    assert told.losses == []
    fig = plot.figure(told)
    assert [ax.get_ylabel() for ax in fig.axes] == ["step", "nodes", "", "steps/s"]
    html = page(told, None, plot.svg(fig), "run")
    assert "loss" not in html.lower()


def test_the_throughput_is_tokens_per_second_when_the_training_reported_its_tokens(tmp_path):
    """The right axis of the step chart: tokens/s a line a round, its ticks in k; the page's
    summary states the tokens and their mean rate over the training time. Read back from a
    run directory as the master writes it, the same as from the events."""
    timeline = _timeline(0.75, losses=False, restart_at=1200, tokens=True)
    run = _written(tmp_path, timeline)
    told = course(rundir.read_timeline(run))
    assert told.tokens == course(timeline).tokens
    written = [e.data["tokens"] for e in timeline if e.data.get("tokens") is not None]
    assert [p.tokens for line in told.tokens for p in line] == written
    assert len(told.tokens) == 2  # the restart starts a new line
    fig = plot.figure(told)
    assert [ax.get_ylabel() for ax in fig.axes] == ["step", "nodes", "", "tokens/s"]
    rate = fig.axes[-1]
    (every,) = {b.time - a.time for line in told.tokens for a, b in itertools.pairwise(line)}
    drawn = [y for line in rate.get_lines() for y in line.get_ydata()]
    assert drawn and drawn == pytest.approx([10 * STEP_TOKENS / every] * len(drawn))
    assert rate.get_lines()[0].get_label() == "tokens/s"
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    ticks = [t.get_text() for t in rate.get_yticklabels() if t.get_text()]
    assert ticks and all(t == "0" or re.fullmatch(r"[\d.]+k", t) for t in ticks), ticks
    assert text_outside(fig) == [] and overlapping(fig) == []

    summary = Summary(
        state="succeeded", reason="done", steps=400, wall_s=100.0, startup_s=10.0,
        downtime_s=5.0, restarts=1, tokens=1_700_000.0,
    )  # fmt: skip
    html = page(told, summary, plot.svg(fig), "run")
    assert (
        "<tr><th>tokens</th><td>1.7M (1,700,000); 20k tokens/s mean over 85.00s of training "
        "(wall time - start-up - recovery)</td></tr>"
    ) in html
    last = told.tokens[-1][-1].tokens
    html = page(told, None, plot.svg(fig), "run")  # no summary: the timeline's count
    assert f"<p>tokens: {last / 1e6:.3g}M ({last:,.0f}) by " in html


def test_the_loss_chart_marks_each_round_start_and_the_page_tells_its_figures(tmp_path):
    told = course(_timeline(0.75, losses=True, restart_at=1200))
    fig = plot.figure(told)
    (chart,) = [ax for ax in fig.axes if ax.get_ylabel() == "loss"]
    curves = [line for line in chart.get_lines() if line.get_label() != "_child"]
    drawn = [
        (x, y) for line in chart.get_lines() if len(line.get_xdata()) > 2
        for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True)
    ]  # fmt: skip
    assert drawn == [(p.time, p.loss) for line in told.losses for p in line]
    (restart,) = [r for r in told.rounds if r.number == 2]
    for ax in (chart, fig.axes[0]):  # the loss and the step charts
        starts = [line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == "--"]
        assert starts == [restart.start], ax.get_ylabel()
    assert curves and text_outside(fig) == [] and overlapping(fig) == []
    assert narrowest_axes(fig) > 0.8
    html = page(told, None, plot.svg(fig), "run")
    last = told.losses[-1][-1]
    assert "<h2>Training loss</h2>" in html
    assert f"<td>last</td><td>{last.step}</td><td>{last.loss:.6g}</td>" in html


def _clock(ax) -> list[str]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(ax.figure).draw()
    return [label.get_text() for label in ax.get_xticklabels() if label.get_text()]


@pytest.mark.parametrize("hours", [3, 30])
def test_a_job_over_an_hour_is_told_in_the_time_of_day(tmp_path, hours):
    """Ticks at whole minutes of the clock (the day too past a day), in the page's local
    time; the text still inside the picture and off each other."""
    told = course(_timeline(hours, losses=True, restart_at=1800))
    fig = plot.figure(told)
    (bottom,) = [ax for ax in fig.axes if ax.get_xlabel()]
    started = datetime.datetime.fromtimestamp(T0).astimezone()
    what = "time of day" if hours < 24 else "date and time"
    assert bottom.get_xlabel() == (
        f"{what} ({started.tzname()}); the job started {started:%Y-%m-%d %H:%M:%S}"
    )
    labels = _clock(bottom)
    ticks = [t for t in bottom.get_xticks() if -0.02 * told.end <= t <= 1.02 * told.end]
    shape = "%H:%M" if hours < 24 else "%m-%d %H:%M"
    assert labels == [datetime.datetime.fromtimestamp(T0 + t).strftime(shape) for t in ticks]
    assert 4 <= len(labels) <= 11
    for t in ticks:  # whole minutes of the clock, evenly spaced
        assert datetime.datetime.fromtimestamp(T0 + t).second == 0
    assert len({round(b - a) for a, b in itertools.pairwise(ticks)}) == 1
    assert text_outside(fig) == [] and overlapping(fig) == []
    assert narrowest_axes(fig) > 0.8


def test_a_job_of_an_hour_or_less_is_told_in_seconds_from_its_start():
    told = course(_timeline(0.9, losses=True))
    fig = plot.figure(told)
    (bottom,) = [ax for ax in fig.axes if ax.get_xlabel()]
    assert bottom.get_xlabel() == "seconds since the job started"
    labels = _clock(bottom)
    assert "0" in labels and not any(":" in label for label in labels)
