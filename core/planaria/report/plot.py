"""The picture of a job's course, drawn with matplotlib.

Why matplotlib, as SVG inlined in the page: the page must open anywhere, offline, years later.
A JavaScript charting bundle would be hundreds of kilobytes in every report (or a CDN the
reader may not reach); matplotlib draws a static SVG of a few tens of kilobytes with its text
as paths (no font to fetch), and the same figure as a PNG for a chat or a ticket. It is an
optional dependency (``pip install 'planaria[report]'``): the core does not need it to train.

Panels on one time axis: the job's step (one line between two faults, so that a restore
shows as the line starting again lower) and its throughput (tokens per second when the
training reported them, ``planaria.monitor.step(n, tokens=...)``; steps per second otherwise),
the checkpoints committed and each fault's span from its detection to its recovery; then rank
0's training loss, when the training reported one (``planaria.monitor.step(n, loss=...)``);
then each node as a bar over the rounds it trained in (its rank and its sampled steps on it, a
cross where it was lost); then one lane a kind of moment (fault, detection, restart, restore,
recovery, checkpoint, straggler), labelled. The start of each round after the first (a
restart) is a dashed line across the step and loss charts: where a curve breaks, and why.

The time axis counts seconds from the job's start; for a job over an hour it shows the time of
day (HH:MM, the report's local time, as the page's start time), which is what one compares with
the other dashboards and logs of a long run.

Why one module: it draws one figure; its panels share the time axis, the colours and the sizes
above, and each panel is a function of the course (:mod:`planaria.report.course`, where the
figures are computed) that reads best beside the others it lines up with.
"""

from __future__ import annotations

import datetime
import io
import math
import re
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planaria.master.tables import si
from planaria.report.course import Course

if TYPE_CHECKING:
    from matplotlib.figure import Figure

LANES = ("fault", "detected", "restart", "restore", "recovered", "checkpoint", "straggler")
FAULT = "#c0392b"
DETECTED = "#e67e22"
RESTART = "#8e44ad"
RESTORE = "#2471a3"
RECOVERED = "#1e8449"
CHECKPOINT = "#7f8c8d"
STRAGGLER = "#b7950b"
THROUGHPUT = "#5dade2"
LOSS = "#d35400"
LOSS_HEIGHT = 2.0
"""The loss chart's height, in inches (the step chart's is about 3)."""
HOUR = 3600.0
"""From this long a job, the time axis shows the time of day."""
CLOCK_STEPS = (60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)
"""Seconds between two ticks of the time of day: the first that gives at most
:data:`CLOCK_TICKS` ticks (whole days beyond)."""
CLOCK_TICKS = 10
DAY = 86400.0
RATE_WINDOW = 0.01
"""The least part of the job's time a throughput figure spans (and a second)."""
MANY_NODES = 12
"""Beyond this many nodes their lines share one colour and the legend names none."""
LABELLED = 10
"""Faults and rounds whose marks are labelled (the last ones): more labels would only cover
each other, and make the picture megabytes."""
WIDTH = 12.0
"""The figure's width in inches."""
AXES_POINTS = WIDTH * 72 * 0.9
"""About how wide the charts are, in points: labels are placed by their estimated width."""
CHAR = 0.62
"""A character's width, about, in ems of the label's font (DejaVu Sans, matplotlib's)."""
END_WIDTH = 140
"""Characters a line of the job's end reason holds, below the chart: at the figure's width and
size 8.5 a line of this many fits with room to spare."""


class MissingMatplotlib(ImportError):
    pass


def figure(course: Course) -> Figure:
    """The job's course as a matplotlib figure (not attached to any pyplot state)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingMatplotlib(str(exc)) from None
    shown = len(course.nodes_seen()) if len(course.nodes_seen()) <= MANY_NODES else 0
    heights = [3, 0.6 + 0.35 * max(shown, 1), 2.2]
    if course.losses:  # a chart of its own, as tall as it is in inches, below the steps
        heights.insert(1, LOSS_HEIGHT)
    tall = 7.5 + 0.35 * shown + (LOSS_HEIGHT if course.losses else 0)
    fig = Figure(figsize=(WIDTH, tall), layout="constrained")
    axes = list(fig.subplots(len(heights), 1, sharex=True, height_ratios=heights))
    steps, nodes, lanes = axes[0], axes[-2], axes[-1]
    _steps(steps, course)
    if course.losses:
        _losses(axes[1], course)
    _nodes(nodes, course, shown > 0)
    _lanes(lanes, course)
    lanes.set_xlim(-0.02 * _span(course), _span(course) * 1.02)
    _time_axis(lanes, course)
    if course.outcome is not None:
        # The end reason may be a paragraph (a crash loop's): below the chart, wrapped to the
        # figure's width. Drawn in a lane it ran off the picture, or squeezed the chart to
        # make room for itself.
        reason = textwrap.fill(f"end: {course.outcome.label}", END_WIDTH, max_lines=4)
        fig.supxlabel(reason, x=0.01, ha="left", fontsize=8.5)
    title = f"{course.job} ({course.run_id})" if course.run_id else course.job
    fig.suptitle(title, fontsize=12)
    return fig


def _steps(ax: Any, course: Course) -> None:
    from matplotlib.ticker import MaxNLocator

    for k, line in enumerate(course.job_steps):
        ax.plot(
            [p.time for p in line],
            [p.step for p in line],
            color="#34495e",
            linewidth=1.8,
            label="step" if k == 0 else None,
        )
    if course.checkpoints:
        ax.scatter(
            [c.time for c in course.checkpoints],
            [c.step for c in course.checkpoints],
            marker="^",
            s=22,
            color=CHECKPOINT,
            zorder=3,
            label="checkpoint committed",
        )
    _round_starts(ax, course)
    for incident in course.incidents:
        end = incident.recovered if incident.recovered is not None else course.end
        ax.axvspan(incident.detected, end, color=FAULT, alpha=0.10, linewidth=0)
        if incident.injected is not None:
            ax.axvline(incident.injected, color=FAULT, linestyle=":", linewidth=1.2)
        ax.axvline(incident.detected, color=FAULT, linewidth=1.4)
        if incident.recovered is not None:
            ax.axvline(incident.recovered, color=RECOVERED, linewidth=1.4)
        if incident.step_before is not None:
            ax.plot([incident.detected], [incident.step_before], "x", color=FAULT, markersize=9)
        if incident.step_after is not None and incident.recovered is not None:
            ax.plot([incident.recovered], [incident.step_after], "o", color=RECOVERED, ms=6)
    if course.first_step is not None:
        ax.axvspan(0, course.first_step, color=CHECKPOINT, alpha=0.08, linewidth=0)
        ax.annotate(
            "start-up",
            xy=(course.first_step / 2, 0),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            fontsize=8,
            color=CHECKPOINT,
        )
    top = _top(course)
    shelves = Shelves(3)
    for incident in reversed(course.incidents[-LABELLED:]):  # the last ones first
        headline = _headline(incident)
        lo, hi, leftwards = _extent(incident.detected, course, headline, 8.5, 8)
        shelf = shelves.place(lo, hi)
        if shelf is None:  # no room left near it: its number still marks the lanes below
            continue
        ax.annotate(
            headline,
            xy=(incident.detected, top * (0.97 - 0.18 * shelf)),  # a row a box's height
            xytext=(-4 if leftwards else 4, 0),
            textcoords="offset points",
            fontsize=8.5,
            va="top",
            ha="right" if leftwards else "left",
            color=FAULT,
            bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": FAULT, "alpha": 0.9},
        )
    ax.set_ylim(bottom=0, top=top * 1.02)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no step 1.25
    ax.set_ylabel("step")
    ax.grid(alpha=0.3)
    rate = _throughput(ax, course)
    if course.job_steps or course.checkpoints:
        handles, labels = ax.get_legend_handles_labels()
        if rate is not None:
            more, named = rate.get_legend_handles_labels()
            handles, labels = handles + more, labels + named
        ax.legend(handles, labels, loc="lower right", fontsize=8)
    else:
        # Below the faults' headlines, which take the top half.
        ax.text(0.5, 0.25, "no step in the timeline", transform=ax.transAxes, ha="center")


def _round_starts(ax: Any, course: Course) -> None:
    """A dashed line where each round after the first started: the workers (re)started
    there, from a restore, so a curve breaks at it."""
    for k, r in enumerate(r for r in course.rounds if r.number > 1):
        ax.axvline(
            r.start,
            color=RESTART,
            linestyle="--",
            linewidth=1,
            alpha=0.7,
            label="round start (restart)" if k == 0 else None,
        )


def _losses(ax: Any, course: Course) -> None:
    """Rank 0's training loss, one line a round: what a TensorBoard or W&B user looks at
    first, on the job's own time axis, so that a jump after a restart is seen beside it."""
    values = [p.loss for line in course.losses for p in line]
    few = len(values) <= 60
    for k, line in enumerate(course.losses):
        ax.plot(
            [p.time for p in line],
            [p.loss for p in line],
            color=LOSS,
            linewidth=1.4,
            marker="." if few else None,
            label="loss (rank 0)" if k == 0 else None,
        )
    _round_starts(ax, course)
    low, high = min(values), max(values)
    if low > 0 and high / low >= 100:  # from ln(vocab) to near zero: the tail is the story
        ax.set_yscale("log")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    last = course.losses[-1][-1]
    ax.legend(loc="upper right", fontsize=8, title=f"last: {last.loss:.4g} at step {last.step}",
              title_fontsize=8)  # fmt: skip


def _time_axis(ax: Any, course: Course) -> None:
    """Seconds since the job started; the time of day (HH:MM, day too beyond a day) for a
    job over :data:`HOUR`, with ticks at whole minutes of the clock."""
    span = _span(course)
    if span <= HOUR:
        ax.set_xlabel("seconds since the job started")
        return
    from matplotlib.ticker import FixedLocator, FuncFormatter

    start = datetime.datetime.fromtimestamp(course.start).astimezone()
    offset = start.utcoffset() or datetime.timedelta(0)
    every = next((s for s in CLOCK_STEPS if span / s <= CLOCK_TICKS), 0.0)
    if not every:
        every = DAY * math.ceil(span / DAY / CLOCK_TICKS)
    # The first tick at a whole multiple of ``every`` on the local clock.
    local = course.start + offset.total_seconds()
    first = math.ceil(local / every) * every - local
    ticks = [first + k * every for k in range(int((span * 1.02 - first) // every) + 1)]
    shape, what = ("%H:%M", "time of day") if span < DAY else ("%m-%d %H:%M", "date and time")

    def clock(x: float, _: object) -> str:
        return datetime.datetime.fromtimestamp(course.start + x).strftime(shape)

    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(clock))
    ax.set_xlabel(f"{what} ({start.tzname()}); the job started {start:%Y-%m-%d %H:%M:%S}")


def _throughput(ax: Any, course: Course) -> Any:
    """The job's throughput on the step chart's right axis (None without two samples in a
    row): tokens per second when the training reported its tokens (what LLM training is
    compared by), steps per second otherwise. A slowdown, a straggler or a throttled chip
    shows as a dip that the step line's slope hides. Each rate spans at least ``RATE_WINDOW``
    of the job, so that two samples a moment apart (from two nodes) do not make a spike."""
    window = max(RATE_WINDOW * _span(course), 1.0)
    unit = "tokens/s"
    lines = _rates([[(p.time, p.tokens) for p in line] for line in course.tokens], window)
    if not lines:  # no tokens, or too few samples of them for a rate
        unit = "steps/s"
        lines = _rates([[(p.time, p.step) for p in line] for line in course.job_steps], window)
    if not lines:
        return None
    right = ax.twinx()
    # Beneath the step chart's own marks, labels and legend.
    right.set_zorder(ax.get_zorder() - 1)
    ax.patch.set_visible(False)
    for k, (times, rates) in enumerate(lines):
        right.plot(
            times,
            rates,
            color=THROUGHPUT,
            linewidth=1,
            alpha=0.8,
            label=unit if k == 0 else None,
        )
    top = max(rate for _, rates in lines for rate in rates)
    right.set_ylim(bottom=0, top=top * 1.3 if top > 0 else 1)
    right.set_ylabel(unit, color=THROUGHPUT)
    right.tick_params(axis="y", colors=THROUGHPUT)
    if unit == "tokens/s":  # 45.6k, 1.2M: six-digit ticks would crowd the right edge
        from matplotlib.ticker import FuncFormatter

        right.yaxis.set_major_formatter(FuncFormatter(lambda value, _: si(value)))
    return right


def _rates(
    lines: list[list[tuple[float, float]]], window: float
) -> list[tuple[list[float], list[float]]]:
    """Per line of (time, count) points, a count that only grows (steps done, tokens so far),
    its rate as a step curve (times, rates): each over ``window`` seconds at the least (the
    last one over what is left). A count that goes back starts again from it."""
    out = []
    for line in lines:
        if not line:
            continue
        times: list[float] = []
        rates: list[float] = []
        start = line[0]
        for k, sample in enumerate(line[1:], start=1):
            if sample[1] < start[1]:  # not in one line; start again from it
                start = sample
                continue
            last = k == len(line) - 1
            if sample[0] - start[0] >= window or (last and sample[0] > start[0]):
                times += [start[0], sample[0]]
                rates += [(sample[1] - start[1]) / (sample[0] - start[0])] * 2
                start = sample
        if times:
            out.append((times, rates))
    return out


def _row_label(name: str, labels: dict[str, str]) -> str:
    """A node's row: its id, and under it its topology labels (``switch=s1``) when it has
    any, so that the rows show which nodes share a switch."""
    if not labels:
        return name
    return name + "\n" + " ".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _nodes(ax: Any, course: Course, each: bool) -> None:
    """Each node a row: a bar a round it trained in, labelled with its rank; its step samples
    as ticks (numbered while few); a cross where it was lost. Too many nodes: one row, the
    number of nodes in each round."""
    ax.set_ylabel("nodes")
    ax.grid(axis="x", alpha=0.3)
    labelled = {r.number for r in course.rounds[-LABELLED:]}
    if not each:
        for r in course.rounds:
            ax.broken_barh([(r.start, r.end - r.start)], (-0.3, 0.6), color="C0", alpha=0.5)
            if r.number in labelled:
                ax.text(r.start, 0, f" {len(r.ranks)} nodes", va="center", fontsize=7.5)
        ax.set_yticks([0], ["all"])
        return
    names = course.nodes_seen()
    row = {name: len(names) - 1 - i for i, name in enumerate(names)}
    room = 0.05 * _span(course)  # a rank label's width, about, in seconds
    lost = {i.where: i.detected for i in course.incidents if i.kind == "node_lost"}
    for i, name in enumerate(names):
        colour = f"C{i % 10}"
        free_from = float("-inf")  # where the row's last label ends: short rounds share one
        for r in course.rounds:
            end = min(r.end, lost.get(name, r.end))
            if name not in r.ranks or end < r.start:
                continue
            ax.broken_barh(
                [(r.start, end - r.start)],
                (row[name] - 0.3, 0.6),
                color=colour,
                alpha=0.35,
                linewidth=0,
            )
            if r.number in labelled and r.start >= free_from:
                ax.text(r.start, row[name], f" rank {r.ranks[name]}", va="center", fontsize=7)
                free_from = r.start + room
        samples = [s for line in course.nodes.get(name, []) for s in line]
        ax.plot([s.time for s in samples], [row[name]] * len(samples), "|", color=colour, ms=9)
        if len(samples) <= 40:
            numbered = float("-inf")  # where the row's last step number ends
            for s in samples:
                # Rank 0's node is sampled at each loss too: samples a moment apart (and
                # the same step twice) get one number, not two over each other.
                lo, hi, leftwards = _extent(s.time, course, str(s.step), 6.5, 2)
                if leftwards:  # it is drawn rightwards all the same
                    lo, hi = hi, 2 * hi - lo
                if lo < numbered:
                    continue
                numbered = hi
                ax.annotate(
                    str(s.step),
                    xy=(s.time, row[name]),
                    xytext=(2, 6),  # over the bar's rank label, not on it
                    textcoords="offset points",
                    fontsize=6.5,
                    color=colour,
                    va="bottom",
                )
    for name, at in lost.items():
        if name in row:
            ax.plot([at], [row[name]], "X", color=FAULT, ms=9)
            leftwards = _extent(at, course, "lost", 7.5, 7)[2]
            ax.annotate(
                "lost",
                xy=(at, row[name]),
                xytext=(-7 if leftwards else 7, -3),
                textcoords="offset points",
                fontsize=7.5,
                color=FAULT,
                ha="right" if leftwards else "left",
            )
    topology = course.topology()
    ax.set_yticks(
        list(row.values()),
        [_row_label(name, topology.get(name, {})) for name in row],
    )
    ax.set_ylim(-0.6, len(names) - 0.4)


def _span(course: Course) -> float:
    """The seconds the time axis shows (at least one)."""
    return max(course.end, 1.0)


def _extent(
    t: float, course: Course, text: str, size: float, offset: float
) -> tuple[float, float, bool]:
    """Where a label of the moment ``t`` lies across the time axis (fractions of its width,
    estimated from its longest line at font ``size`` and ``offset`` points from its mark),
    and whether it reads leftwards: only when reading rightwards would run it off the chart's
    right edge, so that one near the job's end stays inside the picture."""
    span = _span(course)
    at = (t + 0.02 * span) / (1.04 * span)  # the axis shows 2% more on either side
    longest = max((len(line) for line in text.splitlines()), default=0)
    width = (longest * CHAR * size + offset) / AXES_POINTS
    if at + width <= 0.99:
        return at, at + width, False
    return at - width, at, True


class Shelves:
    """Rows of labels (above a mark, below it ...): a label goes on the first row where it
    covers no other label, or on none when every row is taken there, so that close moments
    never print their labels over each other."""

    def __init__(self, rows: int) -> None:
        self.taken: list[list[tuple[float, float]]] = [[] for _ in range(rows)]

    def place(self, lo: float, hi: float) -> int | None:
        for row, spans in enumerate(self.taken):
            if all(hi <= a or lo >= b for a, b in spans):
                spans.append((lo, hi))
                return row
        return None


def _top(course: Course) -> float:
    steps = [s.step for line in course.job_steps for s in line]
    steps += [c.step for c in course.checkpoints]
    return float(max(steps, default=1)) * 1.1 + 1


def _headline(incident: Any) -> str:
    lines = [f"{incident.number}: {incident.kind} ({incident.where})"]
    if incident.restore:
        lines.append(f"restore: {incident.restore}")
    if incident.recovery_s is not None:
        lost = "" if incident.steps_lost is None else f", {incident.steps_lost} step(s) lost"
        lines.append(f"recovered in {incident.recovery_s:.2f}s{lost}")
    else:
        lines.append("not recovered")
    return "\n".join(lines)


def _lanes(ax: Any, course: Course) -> None:
    row = {name: len(LANES) - 1 - i for i, name in enumerate(LANES)}

    shelves = {lane: Shelves(2) for lane in LANES}  # a lane's labels: above its marks, below

    def mark(lane: str, t: float, colour: str, label: str = "", shape: str = "o") -> None:
        ax.plot([t], [row[lane]], shape, color=colour, markersize=7)
        if not label:
            return
        lo, hi, leftwards = _extent(t, course, label, 7.5, 5)
        below = shelves[lane].place(lo, hi)
        if below is not None:
            ax.annotate(
                label,
                xy=(t, row[lane]),
                # Centred half a lane's height (22 points at the least) from the lane: off
                # its mark, clear of the next lane's labels.
                xytext=(-5 if leftwards else 5, -6 if below else 6),
                textcoords="offset points",
                fontsize=7.5,
                color=colour,
                ha="right" if leftwards else "left",
                va="center",
            )

    labelled = {i.number for i in course.incidents[-LABELLED:]}
    for i in reversed(course.incidents):  # the last ones' labels first, where it is crowded
        if i.number not in labelled:
            _unlabelled(ax, row, i, course.end)
            continue
        fault_at = i.injected if i.injected is not None else i.detected
        mark("fault", fault_at, FAULT, f"{i.number}: {i.kind}", "X")
        mark("detected", i.detected, DETECTED, f"{i.number}: {i.where}")
        if i.restarted is not None:
            label = f"{i.number}: round {i.round}"
            if i.replaced_by:
                label += f", {i.replaced_by} in"
            mark("restart", i.restarted, RESTART, label)
        if i.restored is not None and i.restore:
            where = "memory" if i.restore.startswith("memory") else "storage"
            mark("restore", i.restored, RESTORE, f"{i.number}: {where}", "s")
        if i.recovered is not None:
            took = f"{i.number}: {i.recovery_s or 0:.2f}s"
            mark("recovered", i.recovered, RECOVERED, took)
        span_end = i.recovered if i.recovered is not None else course.end
        ax.plot([fault_at, span_end], [row["fault"]] * 2, color=FAULT, alpha=0.4, linewidth=3)
    if course.checkpoints:
        at = [c.time for c in course.checkpoints]
        ax.plot(at, [row["checkpoint"]] * len(at), "^", color=CHECKPOINT, markersize=5)
    for s in course.stragglers:
        mark("straggler", s.time, STRAGGLER, s.label, "D")
    if course.outcome is not None:  # its reason is written below the chart
        ax.axvline(course.outcome.time, color="black", linewidth=1, linestyle="--")
        ax.annotate(
            "end",
            xy=(course.outcome.time, row["straggler"]),
            xytext=(-4, 0),
            textcoords="offset points",
            fontsize=7.5,
            ha="right",
        )
    ax.set_yticks(list(row.values()), list(row.keys()))
    ax.set_ylim(-0.7, len(LANES) - 0.3)
    ax.grid(axis="x", alpha=0.3)


def _unlabelled(ax: Any, row: dict[str, int], i: Any, end: float) -> None:
    """A fault's moments as marks only."""
    fault_at = i.injected if i.injected is not None else i.detected
    moments = [("fault", fault_at, FAULT), ("detected", i.detected, DETECTED)]
    moments += [("restart", i.restarted, RESTART), ("restore", i.restored, RESTORE)]
    moments += [("recovered", i.recovered, RECOVERED)]
    for lane, at, colour in moments:
        if at is not None:
            ax.plot([at], [row[lane]], "o", color=colour, markersize=4)
    span_end = i.recovered if i.recovered is not None else end
    ax.plot([fault_at, span_end], [row["fault"]] * 2, color=FAULT, alpha=0.4, linewidth=3)


def svg(fig: Figure) -> str:
    """The figure as an SVG element to inline in HTML: without the XML prolog, the DOCTYPE
    and the metadata (whose namespace addresses are no links, but need not be there)."""
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", metadata={"Date": None})
    text = buffer.getvalue()
    text = text[text.index("<svg") :]
    return re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)


def png(fig: Figure, path: Path) -> None:
    fig.savefig(path, format="png", dpi=110)
