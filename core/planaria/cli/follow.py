"""What ``planaria run`` shows of a job: its events and its workers' lines as they come, a
live status table on a terminal, and the summary (with the pre-flight check's) at its end.
The run itself hears none of it: all of it comes through :class:`RunHooks` (:data:`HOOKS`)."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

from rich.live import Live
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from planaria import log
from planaria.agent.console import prefix
from planaria.cli.output import out, warning
from planaria.diagnosis.preflight import PreflightReport
from planaria.events import EventKind, JobEvent
from planaria.master.advertise import Advertised
from planaria.master.job import Master
from planaria.master.runner import RunHooks
from planaria.master.summary import Summary
from planaria.master.tables import (
    FAULT_COLUMNS,
    STRAGGLER_COLUMNS,
    fault_rows,
    straggler_rows,
    summary_rows,
)
from planaria.protocol import JobSpec, WorkersOutput

EVENT_STYLE = {
    EventKind.FAULT_DETECTED: "bold red",
    EventKind.WORKERS_RESTARTED: "yellow",
    EventKind.RECOVERED: "green",
    EventKind.NODE_REPLACED: "yellow",
    EventKind.NODE_REPLACEMENT_FAILED: "bold red",
    EventKind.NODE_REMOVED: "yellow",
    EventKind.JOB_FINISHED: "bold green",
    EventKind.JOB_STOPPED: "bold red",
}


def _status_table(master: Master) -> Table:
    status = master.status()
    table = Table(title=f"{status.job} - {status.state}", expand=False)
    for column in ("round", "steps done", "restarts", "nodes"):  # counted as the summary counts
        table.add_column(column)
    up = sum(1 for n in status.nodes if n.node_rank is not None and n.state == "running")
    table.add_row(
        str(status.round),
        str(status.steps_done),
        f"{status.restarts}/{status.max_restarts}",
        f"{up} running / {len(status.nodes)} known",
    )
    return table


def _print_event(event: JobEvent) -> None:
    if event.kind is EventKind.PROGRESS:  # samples for the report, not news
        return
    style = EVENT_STYLE.get(event.kind)
    text = f"{log.timestamp(event.time)} {event.kind.value:<22} {event.message}"
    out.print(f"[{style}]{text}[/]" if style else text, markup=bool(style), highlight=False)


def _print_output(report: WorkersOutput) -> None:
    """The workers' lines, each with its rank's prefix, in one write: lines stay whole among
    the event lines (:mod:`planaria.agent.console`)."""
    text = "\n".join(prefix(line.rank) + line.text for line in report.lines)
    if report.dropped:
        note = (
            f"planaria: {report.dropped} line(s) of node {report.node_id}'s workers not shown "
            "(the console could not keep up); the logs have them"
        )
        text = f"{text}\n{note}" if text else note
    # Text, not markup; no folding: a long line is one line, as the worker wrote it.
    out.print(Text(text), highlight=False, soft_wrap=True)


def _print_table(table: Table) -> None:
    """On a terminal a table fits the terminal. Elsewhere (a CI log, ``| tee``) there is no
    width to fit, and rich's default of 80 columns would fold every long cell to a few words a
    line: print the table as wide as its content, one line per row."""
    if out.is_terminal:
        out.print(table)
        return
    natural = Measurement.get(out, out.options.update_width(1 << 16), table).maximum
    width = out.width
    out.width = max(width, natural)
    try:
        out.print(table)
    finally:
        out.width = width


def print_summary(summary: Summary, run_dir: Path) -> None:
    table = Table(title="summary", show_header=False)
    table.add_column("what")
    table.add_column("value")
    # Text, not markup: values carry file names and error messages.
    for row in summary_rows(summary):
        table.add_row(Text(row.what, "bold red" if row.alarm else ""), Text(row.value))
    _print_table(table)
    for title, columns, rows in (
        ("faults", FAULT_COLUMNS, fault_rows(summary)),
        ("stragglers", STRAGGLER_COLUMNS, straggler_rows(summary)),
    ):
        if not rows:
            continue
        part = Table(title=title)
        for column in columns:
            part.add_column(column, overflow="fold")
        for cells in rows:
            part.add_row(*(Text(c) for c in cells))
        _print_table(part)
    if summary.preflight is not None:
        print_preflight(summary.preflight)
    failed = summary.failed_rank
    if failed is not None and failed.tail:
        where = f" ({failed.log})" if failed.log else ""
        out.print(Text(f"last lines of rank {failed.rank}{where}:", "bold red"))
        out.print(Text(textwrap.indent(failed.tail, "  ")), highlight=False, soft_wrap=True)
    logs = Path(failed.log).parent if failed is not None and failed.log else run_dir / "logs"
    out.print(f"timeline: {run_dir / 'events.jsonl'}\nlogs: {logs}", markup=False)


def preflight_line(report: PreflightReport) -> str:
    """The whole pre-flight summary when no node needed a verdict: one line, not a table."""
    if report.nodes == 0:
        return "pre-flight: no node was checked"
    nodes = f"{report.nodes} node{'s' if report.nodes != 1 else ''}"
    rounds = f"{report.rounds} round{'s' if report.rounds != 1 else ''}"
    spread = "; ".join(
        f"{measure}: slowest {seconds * 1000:.1f} ms on {node}, "
        f"median {report.baseline.get(measure, seconds) * 1000:.1f} ms"
        for measure, (node, seconds) in report.slowest.items()
    )
    return f"pre-flight: all {nodes} passed in {rounds}" + (f" ({spread})" if spread else "")


def print_preflight(report: PreflightReport) -> None:
    if not report.verdicts:
        out.print(preflight_line(report), markup=False)
        return
    base = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in report.baseline.items()) or "-"
    title = (
        f"pre-flight: {report.nodes} node(s), {report.rounds} round(s); good nodes' median {base}"
    )
    table = Table(title=title)
    for column in ("node", "host", "verdict", "round 1", "detail", "action"):
        table.add_column(column, overflow="fold")
    for v in report.verdicts:
        table.add_row(
            v.node,
            report.hosts.get(v.node, "-"),
            v.kind,
            v.first,
            v.detail,
            report.actions.get(v.node, "-"),
        )
    _print_table(table)


async def _follow(master: Master, job: asyncio.Future[Summary]) -> Summary:
    """On a terminal, a live status table while the job runs."""
    if not out.is_terminal:
        return await job
    with Live(_status_table(master), console=out, refresh_per_second=4) as live:
        while not job.done():
            live.update(_status_table(master))
            await asyncio.wait({job}, timeout=0.25)
    return job.result()


def _started(spec: JobSpec, url: str) -> None:
    out.print(f"planaria: job {spec.job} (run {spec.run_id}), master at {url}")


def _advertised(advertised: Advertised) -> None:
    out.print(
        f"planaria: agents are told the master is at {advertised.address}: "
        f"{advertised.why} (master.host binds every interface; set master.advertise to "
        "choose)",
        markup=False,
    )


HOOKS = RunHooks(
    on_event=_print_event,
    on_start=_started,
    on_warning=warning,
    on_advertise=_advertised,
    follow=_follow,
    on_output=_print_output,
)
