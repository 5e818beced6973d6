"""``planaria status``: a job's state, nodes and recent events, while it runs or after."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from planaria import log
from planaria.cli.app import JsonOption, app
from planaria.cli.output import out, print_json


def topology_text(labels: dict[str, str]) -> str:
    """``switch=s1``, labels sorted, ``-`` for none."""
    return " ".join(f"{k}={v}" for k, v in sorted(labels.items())) or "-"


@app.command("status")
def status_command(
    run_dir: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Argument(help="the run directory (planaria-runs/<run>)", show_default=False),
    ] = None,
    master: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            "--master",
            metavar="URL",
            help="ask this master (token from RUN_DIR, else PLANARIA_TOKEN)",
            show_default=False,
        ),
    ] = None,
    events: Annotated[int, typer.Option("--events", help="recent events to show")] = 10,
    json_: JsonOption = False,
) -> None:
    """Show a job's state: its nodes (id, host, state, rank, last step, and topology labels
    when the scheduler gives them), round, steps done and recent events; asked of its master
    while it runs, read from RUN_DIR once it is over.

    Exit 2 when RUN_DIR is not a run directory or the master cannot be asked.
    """
    from planaria.status import view

    job = view(run_dir, master, events)
    if json_:
        print_json(job.as_json())
        return
    status = job.status
    # A count, then the last step's number: a script numbering its steps from 0 has done 120
    # at step 119.
    last = f" (last step {status.step})" if status.step >= 0 else ""
    over = "" if job.running else " (over)" if status.state in ("succeeded", "failed") else ""
    out.print(
        Text(
            f"{status.job} (run {status.run_id}): {status.state}{over}, round {status.round}, "
            f"steps done {status.steps_done}{last}, "
            f"restarts {status.restarts}/{status.max_restarts}"
        )
    )
    if status.reason:
        out.print(Text(status.reason))
    out.print(Text(f"from {job.source}", "dim"))
    table = Table(title="nodes")
    # Where each node stands, when the scheduler said: what a topology placement groups by.
    placed = any(node.topology for node in status.nodes)
    for column in ("node", "host", "state", "rank", "last step", "topology")[: 6 if placed else 5]:
        table.add_column(column)
    for node in status.nodes:
        rank = "-" if node.node_rank is None else str(node.node_rank)
        step = "-" if node.step < 0 else str(node.step)
        row = [node.node_id, node.host, node.state, rank, step]
        if placed:
            row.append(topology_text(node.topology))
        table.add_row(*row)
    out.print(table)
    for event in job.events:
        out.print(
            Text(f"{log.timestamp(event.time)} {event.kind.value:<22} {event.message}"),
        )
