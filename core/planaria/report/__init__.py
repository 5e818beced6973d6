"""A run's report: one self-contained HTML page (and, if asked, a PNG) that shows the job over
time (each node's steps, each fault with its detection, restart, restore and recovery, the
checkpoints, the stragglers) and the summary ``planaria run`` printed.

Read from the run directory only (:mod:`planaria.rundir`), so that it can be made during the
job, at its end (``planaria run`` writes ``report.html``), or any time after.
"""

from __future__ import annotations

from pathlib import Path

from planaria import install, rundir
from planaria.errors import PlanariaError
from planaria.report.course import Course, Incident, course
from planaria.report.page import page

__all__ = ["REPORT_FILE", "Course", "Incident", "ReportError", "course", "write_report"]

REPORT_FILE = "report.html"


class ReportError(PlanariaError):
    """A report cannot be made: matplotlib is missing, or a file cannot be written."""


def write_report(run_dir: Path, output: Path | None = None, png: Path | None = None) -> Path:
    """Write the report of ``run_dir`` to ``output`` (default: ``report.html`` in it), and the
    picture to ``png`` when given; the page's path. Raises :class:`planaria.rundir.RunDirError`
    for a run directory that cannot be read, :class:`ReportError` otherwise."""
    from planaria.report import plot

    run_dir = rundir.run_dir(run_dir)
    summary = rundir.summary(run_dir)
    told = course(rundir.read_timeline(run_dir), summary)
    try:
        fig = plot.figure(told)
    except plot.MissingMatplotlib as exc:
        raise ReportError(
            f"a report needs matplotlib ({exc}): {install.hint(install.CORE, 'report')}"
        ) from None
    output = output or run_dir / REPORT_FILE
    try:
        output.write_text(page(told, summary, plot.svg(fig), str(run_dir)), encoding="utf-8")
        if png is not None:
            plot.png(fig, png)
    except OSError as exc:
        raise ReportError(f"cannot write the report: {exc}") from None
    return output
