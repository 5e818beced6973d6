"""``planaria report``: a run directory's report, one self-contained HTML page (and a PNG)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from planaria.cli.app import app
from planaria.cli.output import out


@app.command("report")
def report_command(
    run_dir: Annotated[
        Path, typer.Argument(help="the run directory (planaria-runs/<run>)", show_default=False)
    ],
    output: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(
            "--output",
            "-o",
            help="the HTML file (default: RUN_DIR/report.html)",
            show_default=False,
        ),
    ] = None,
    png: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option("--png", help="also write the picture to this PNG file", show_default=False),
    ] = None,
) -> None:
    """Write a run's report: its steps, faults and recoveries over time, and its summary.

    Exit 2 when RUN_DIR is not a run directory or its timeline is damaged.
    """
    from planaria.report import REPORT_FILE, write_report

    written = write_report(run_dir, output or run_dir / REPORT_FILE, png)
    out.print(f"report: {written}", markup=False, highlight=False)
    if png is not None:
        out.print(f"picture: {png}", markup=False, highlight=False)
