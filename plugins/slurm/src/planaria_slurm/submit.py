"""``planaria submit`` for Slurm: a batch script that runs ``planaria run`` on the allocation,
handed to ``sbatch --parsable``.

The allocation has the job's most nodes plus ``spares``, and ``--no-kill``: a node that goes
down ends its own step only, the job replaces it on a spare. Nodes found bad by earlier runs of
the same job (remembered in ``<workdir>/.planaria``) are excluded. Every value is quoted for
the shell or checked to be one word by the options model: no config string becomes shell code.
"""

from __future__ import annotations

import os
import shlex
import tempfile
from pathlib import Path

from planaria.plugin import SchedulerError, SubmitRequest, SubmitResult
from planaria_slurm import commands, state
from planaria_slurm.options import SlurmOptions

STATE_DIR = ".planaria"


def state_dir(options: SlurmOptions, request: SubmitRequest) -> Path:
    if options.state_dir is not None:
        return (
            options.state_dir
            if options.state_dir.is_absolute()
            else (request.directory / options.state_dir)
        )
    return request.workdir / STATE_DIR


def script(options: SlurmOptions, request: SubmitRequest) -> str:
    """The batch script (its text); see the module docstring."""
    where = state_dir(options, request)
    bad = sorted(state.load(where))
    lines = [
        "#!/bin/sh",
        f"#SBATCH --job-name={request.job}",
        f"#SBATCH --nodes={request.max_nodes + options.spares}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --no-kill",
        f"#SBATCH --chdir={request.directory}",
        f"#SBATCH --output={where / 'slurm-%j.out'}",
    ]
    for flag, value in (
        ("partition", options.partition),
        ("time", options.time),
        ("account", options.account),
        ("gres", options.gres),
        ("gpus-per-node", options.gpus_per_node),
        ("constraint", options.constraint),
    ):
        if value is not None:
            lines.append(f"#SBATCH --{flag}={value}")
    if bad:
        lines.append(f"#SBATCH --exclude={','.join(bad)}")
    if options.requeue:
        lines.append("#SBATCH --requeue")
    lines += [f"#SBATCH {line}" for line in options.sbatch]
    run = [
        request.python,
        "-m",
        "planaria",
        "run",
        str(request.config),
        *[arg for override in request.overrides for arg in ("--set", override)],
        "--set",
        f"scheduler.options.state_dir={where}",
    ]
    lines += [
        "",
        f"# Written by planaria submit: job {request.job}, {request.min_nodes}-"
        f"{request.max_nodes} node(s) of {request.procs_per_node} worker(s), "
        f"{options.spares} spare(s).",
        f"exec {shlex.join(run)}",
        "",
    ]
    return "\n".join(lines)


def _check_lines(text: str) -> None:
    for line in text.splitlines():
        if line.startswith("#SBATCH") and any(c in line for c in "\r\0"):
            raise SchedulerError(f"cannot write the batch script: {line!r} holds a control byte")


def submit(options: SlurmOptions, request: SubmitRequest, *, dry_run: bool) -> SubmitResult:
    text = script(options, request)
    _check_lines(text)
    if dry_run:
        return SubmitResult(script=text)
    where = state_dir(options, request)
    try:
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise SchedulerError(
            f"cannot create {where} (the batch job's output and state go there): {exc}"
        ) from None
    fd, path = tempfile.mkstemp(prefix="submit-", suffix=".sh", dir=where)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        job_id = commands.run(["sbatch", "--parsable", path]).strip().split(";")[0]
    finally:
        os.unlink(path)  # sbatch keeps its own copy
    if not job_id:
        raise SchedulerError("sbatch printed no job id")
    return SubmitResult(script=text, job_id=job_id)
