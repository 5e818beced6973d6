"""The picture of a job's course, drawn with matplotlib.

Why matplotlib, as SVG inlined in the page: the page must open anywhere, offline, years later.
A JavaScript charting bundle would be hundreds of kilobytes in every report (or a CDN the
reader may not reach); matplotlib draws a static SVG of a few tens of kilobytes with its text
as paths (no font to fetch), and the same figure as a PNG for a chat or a ticket. It is an
optional dependency (``pip install 'planaria[report]'``): the core does not need it to train.

Two panels on one time axis: above, each node's steps (one line a round, so that a restart
shows as the line starting again where it restored), the checkpoints committed, each fault's
span from its detection to its recovery; below, one lane a kind of moment (fault, detection,
restart, restore, recovery, checkpoint, straggler), labelled.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
MANY_NODES = 12
"""Beyond this many nodes their lines share one colour and the legend names none."""


class MissingMatplotlib(ImportError):
    pass


def figure(course: Course) -> Figure:
    """The job's course as a matplotlib figure (not attached to any pyplot state)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingMatplotlib(str(exc)) from None
    fig = Figure(figsize=(12, 7.5), layout="constrained")
    steps, lanes = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    _steps(steps, course)
    _lanes(lanes, course)
    end = max(course.end, 1.0)
    lanes.set_xlim(-0.02 * end, end * 1.02)
    lanes.set_xlabel("seconds since the job started")
    title = f"{course.job} ({course.run_id})" if course.run_id else course.job
    fig.suptitle(title, fontsize=12)
    return fig


def _steps(ax: Any, course: Course) -> None:
    many = len(course.nodes) > MANY_NODES
    colours = [f"C{i}" for i in range(10)]
    for i, (node, lines) in enumerate(sorted(course.nodes.items())):
        colour = "C0" if many else colours[i % len(colours)]
        for j, line in enumerate(lines):
            ax.plot(
                [s.time for s in line],
                [s.step for s in line],
                marker="o" if not many else None,
                markersize=3,
                linewidth=1.2 if many else 1.8,
                color=colour,
                alpha=0.5 if many else 0.9,
                label=node if j == 0 and not many else None,
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
    for k, incident in enumerate(course.incidents):
        ax.annotate(
            _headline(incident),
            xy=(incident.detected, top * (0.97 - 0.16 * (k % 3))),
            xytext=(4, 0),
            textcoords="offset points",
            fontsize=8.5,
            va="top",
            color=FAULT,
            bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": FAULT, "alpha": 0.9},
        )
    ax.set_ylim(bottom=0, top=top * 1.02)
    ax.set_ylabel("step")
    ax.grid(alpha=0.3)
    if course.nodes or course.checkpoints:
        ax.legend(loc="lower right", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no step in the timeline", transform=ax.transAxes, ha="center")


def _top(course: Course) -> float:
    steps = [s.step for lines in course.nodes.values() for line in lines for s in line]
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

    def mark(
        lane: str, t: float, colour: str, label: str = "", shape: str = "o", below: bool = False
    ) -> None:
        ax.plot([t], [row[lane]], shape, color=colour, markersize=7)
        if label:  # close moments: every other label below its mark, not on its neighbour's
            ax.annotate(
                label,
                xy=(t, row[lane]),
                xytext=(5, -11 if below else 4),
                textcoords="offset points",
                fontsize=7.5,
                color=colour,
            )

    for i in course.incidents:
        below = i.number % 2 == 0
        fault_at = i.injected if i.injected is not None else i.detected
        mark("fault", fault_at, FAULT, f"{i.number}: {i.kind}", "X", below)
        mark("detected", i.detected, DETECTED, f"{i.number}: {i.where}", below=below)
        if i.restarted is not None:
            label = f"{i.number}: round {i.round}"
            if i.replaced_by:
                label += f", {i.replaced_by} in"
            mark("restart", i.restarted, RESTART, label, below=below)
        if i.restored is not None and i.restore:
            where = "memory" if i.restore.startswith("memory") else "storage"
            mark("restore", i.restored, RESTORE, f"{i.number}: {where}", "s", below)
        if i.recovered is not None:
            took = f"{i.number}: {i.recovery_s or 0:.2f}s"
            mark("recovered", i.recovered, RECOVERED, took, below=below)
        span_end = i.recovered if i.recovered is not None else course.end
        ax.plot([fault_at, span_end], [row["fault"]] * 2, color=FAULT, alpha=0.4, linewidth=3)
    for c in course.checkpoints:
        ax.plot([c.time], [row["checkpoint"]], "^", color=CHECKPOINT, markersize=5)
    for s in course.stragglers:
        mark("straggler", s.time, STRAGGLER, s.label, "D")
    if course.outcome is not None:
        ax.axvline(course.outcome.time, color="black", linewidth=1, linestyle="--")
        ax.annotate(
            course.outcome.label,
            xy=(course.outcome.time, row["straggler"]),
            xytext=(-4, 0),
            textcoords="offset points",
            fontsize=7.5,
            ha="right",
        )
    ax.set_yticks(list(row.values()), list(row.keys()))
    ax.set_ylim(-0.7, len(LANES) - 0.3)
    ax.grid(axis="x", alpha=0.3)


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
