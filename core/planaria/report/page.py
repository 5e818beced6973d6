"""The report as one HTML page: the picture inlined, the summary ``planaria run`` printed, each
fault's story, and the timeline's events. Everything is in the file (style included): it
opens offline and can be mailed as it is. Every text from the run is escaped. Its size is
bounded whatever the run: the faults are counted by kind and the last ones listed, and the
events listed are the first and the last ones."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from html import escape

from planaria.events import JobEvent
from planaria.master.summary import Summary
from planaria.master.tables import (
    FAULT_COLUMNS,
    FAULT_KIND_COLUMNS,
    STRAGGLER_COLUMNS,
    fault_kind_rows,
    fault_rows,
    si,
    straggler_rows,
    summary_rows,
)
from planaria.report.course import FIRST_EVENTS, Course, Incident

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left;
         vertical-align: top; overflow-wrap: anywhere; }
th { background: #f3f3f3; }
td.alarm { color: #b03a2e; font-weight: bold; }
.figure svg { width: 100%; height: auto; }
.muted { color: #777; }
tr.fault td { background: #fdedec; } tr.recovered td { background: #e9f7ef; }
"""

PAGE_FAULTS = 20
"""The summary's faults listed on the page: the last ones (all are counted by kind)."""

EVENT_CLASS = {
    "fault_detected": "fault",
    "hang_detected": "fault",
    "node_replacement_failed": "fault",
    "job_stopped": "fault",
    "recovered": "recovered",
    "job_finished": "recovered",
}


def page(course: Course, summary: Summary | None, figure_svg: str | None, source: str) -> str:
    title = f"planaria report: {course.job}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f'<p class="muted">run {escape(course.run_id)}, started {_when(course.start)}; '
        f"from {escape(source)}</p>",
    ]
    if figure_svg is not None:
        parts.append(f'<div class="figure">{figure_svg}</div>')
    parts.append("<h2>Summary</h2>")
    if summary is None:
        parts.append(
            '<p class="muted">The run wrote no summary (summary.json): its master did not see '
            "the job end. What follows is from the timeline.</p>"
        )
        if course.tokens:  # the summary's tokens row, as far as the timeline tells
            last = course.tokens[-1][-1]
            parts.append(
                f"<p>tokens: {si(last.tokens)} ({last.tokens:,.0f}) by {last.time:.2f}s, "
                "the timeline's last count</p>"
            )
    else:
        parts.append(_summary(summary))
        if summary.faults:
            parts += ["<h2>Faults</h2>", _table(FAULT_KIND_COLUMNS, fault_kind_rows(summary))]
            if len(summary.faults) > PAGE_FAULTS:
                parts.append(f'<p class="muted">The last {PAGE_FAULTS} faults:</p>')
            parts.append(_table(FAULT_COLUMNS, fault_rows(summary, 0, PAGE_FAULTS)))
        stragglers = straggler_rows(summary)
        if stragglers:
            parts += ["<h2>Stragglers</h2>", _table(STRAGGLER_COLUMNS, stragglers)]
    topology = course.topology()
    if topology:
        parts += ["<h2>Nodes</h2>", _nodes(course, topology)]
    if course.losses:
        parts += ["<h2>Training loss</h2>", _losses(course)]
    if course.incidents:
        parts.append("<h2>Each fault, from the timeline</h2>")
        if course.faults > len(course.incidents):
            kinds = ", ".join(f"{n} {kind}" for kind, n in course.fault_kinds.items())
            parts.append(
                f'<p class="muted">The last {len(course.incidents)} of {course.faults} faults '
                f"({escape(kinds)}):</p>"
            )
        parts.append(_incidents(course.incidents))
    parts += ["<h2>Events</h2>", _events(course)]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _when(epoch: float) -> str:
    return escape(datetime.datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M:%S"))


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def _text(value: str) -> str:
    return escape(value).replace("\n", "<br>")


def _summary(summary: Summary) -> str:
    html = ["<table>"]
    for row in summary_rows(summary):
        failed = row.what == "result" and summary.state != "succeeded"
        css = ' class="alarm"' if row.alarm or failed else ""
        html.append(f"<tr><th>{escape(row.what)}</th><td{css}>{_text(row.value)}</td></tr>")
    html.append("</table>")
    rank = summary.failed_rank
    if rank is not None and rank.tail:
        html.append(f"<p>last lines of rank {rank.rank}:</p><pre>{escape(rank.tail)}</pre>")
    return "\n".join(html)


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    html = ["<table>", "<tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>"]
    for row in rows:
        html.append("<tr>" + "".join(f"<td>{_text(c)}</td>" for c in row) + "</tr>")
    html.append("</table>")
    return "\n".join(html)


def _losses(course: Course) -> str:
    """Rank 0's loss at the first and last points of the series and at its lowest: the
    figures beside the curve, as the worker reported them (to six significant digits), where
    a chart only shows where they lie."""
    points = [p for line in course.losses for p in line]
    lowest = min(points, key=lambda p: p.loss)
    rows = [
        (what, str(p.step), f"{p.loss:.6g}", f"{p.time:.2f}s")
        for what, p in (("first", points[0]), ("lowest", lowest), ("last", points[-1]))
    ]
    note = (
        f'<p class="muted">Rank 0\'s loss as its heartbeats brought it: {len(points)} points, '
        "one a heartbeat at most (a long run's spread over it).</p>"
    )
    return note + "\n" + _table(("", "step", "loss", "at"), rows)


def _nodes(course: Course, topology: dict[str, dict[str, str]]) -> str:
    """Each node's topology labels (what a topology rank placement groups by) and its node
    rank in each round it was in: whether nodes of one switch held contiguous ranks."""
    rows = []
    for name in course.nodes_seen():
        labels = topology.get(name, {})
        ranks = ", ".join(
            f"{r.ranks[name]} (round {r.number})" for r in course.rounds if name in r.ranks
        )
        rows.append(
            (name, " ".join(f"{k}={v}" for k, v in sorted(labels.items())) or "-", ranks or "-")
        )
    return _table(("node", "topology", "node rank"), rows)


def _incidents(incidents: list[Incident]) -> str:
    header = (
        "#",
        "fault",
        "where",
        "injected at",
        "detected at",
        "restart (round)",
        "restore",
        "recovered at",
        "recovery",
        "steps lost",
    )
    rows = [
        (
            str(i.number),
            i.kind + (f" ({i.fault_class})" if i.fault_class else ""),
            i.where + (f", replaced by {i.replaced_by}" if i.replaced_by else ""),
            _seconds(i.injected),
            _seconds(i.detected),
            "-" if i.restarted is None else f"{i.restarted:.2f}s ({i.round})",
            f"{i.restore} at {i.restored:.2f}s" if i.restore and i.restored is not None else "-",
            _seconds(i.recovered),
            _seconds(i.recovery_s),
            "-" if i.steps_lost is None else str(i.steps_lost),
        )
        for i in incidents
    ]
    return _table(header, rows)


def _events(course: Course) -> str:
    html = ["<table><tr><th>at</th><th>kind</th><th>node</th><th>rank</th><th>step</th>"]
    html.append("<th>what</th></tr>")
    for k, event in enumerate(course.events):
        if course.events_left_out and k == FIRST_EVENTS:
            left_out = f"... {course.events_left_out} more events: the timeline has them all"
            html.append(f'<tr><td colspan="6" class="muted">{left_out}</td></tr>')
        html.append(_event_row(event, event.time - course.start))
    html.append("</table>")
    return "\n".join(html)


def _event_row(event: JobEvent, at: float) -> str:
    css = EVENT_CLASS.get(event.kind.value)
    cells = (
        f"{at:.2f}s",
        event.kind.value,
        event.node or "",
        "" if event.rank is None else str(event.rank),
        "" if event.step is None else str(event.step),
        event.message,
    )
    row = "".join(f"<td>{escape(c)}</td>" for c in cells)
    return f'<tr class="{css}">{row}</tr>' if css else f"<tr>{row}</tr>"
