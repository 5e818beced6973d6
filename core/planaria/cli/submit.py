"""``planaria submit``: hand the job to the cluster manager as a batch job that runs
``planaria run`` on the allocation it gets (Slurm's ``sbatch``), instead of running it here."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from planaria.cli.app import SetOption, app, load_job
from planaria.cli.output import out
from planaria.errors import ConfigError, ConfigIssue
from planaria.scheduler.api import Scheduler, SubmitRequest


@app.command("submit")
def submit_command(
    file: Annotated[Path, typer.Argument(help="job config file (YAML or TOML)")],
    set_: SetOption = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="print the batch script, submit nothing")
    ] = False,
) -> None:
    """Submit a job to the configured scheduler as a batch job (e.g. sbatch), which runs
    ``planaria run`` on its allocation. Prints the job id (exit 0), or the batch script with
    ``--dry-run``; a refused submission exits 2 with the cluster manager's own message.
    A dry run does not ask the cluster (its partitions, its allocation)."""
    overrides = set_ or []
    resolved, _ = load_job(file, overrides, ask_cluster=not dry_run)
    chosen = resolved.backends.get("scheduler")
    if chosen is None:
        backend = resolved.config.scheduler.backend
        issue = ConfigIssue("scheduler.backend", f"scheduler {backend!r} is not installed")
        raise ConfigError([issue], resolved.source)
    factory: type[Scheduler[Any]] = chosen.record.factory
    job = resolved.config.job
    here = Path.cwd()
    request = SubmitRequest(
        config=Path(os.path.abspath(file)),
        overrides=tuple(overrides),
        job=job.name,
        min_nodes=job.nodes.min,
        max_nodes=job.nodes.max,
        standby=job.standby,
        procs_per_node=job.procs_per_node,
        workdir=Path(os.path.abspath(job.workdir.expanduser())),
        directory=here,
        python=sys.executable,
    )
    result = factory.submit(chosen.options, request, dry_run=dry_run)
    if dry_run:
        sys.stdout.write(result.script)
        sys.stdout.flush()
    else:
        out.print(f"planaria: submitted job {job.name} as {factory.name} job {result.job_id}")
