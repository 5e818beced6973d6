"""``planaria submit`` for Slurm: a batch script that runs ``planaria run`` on the allocation,
handed to ``sbatch --parsable``.

The allocation has the job's most nodes, the nodes standing by (``job.standby``) and
``spares``, and ``--no-kill``: a node that goes
down ends its own step only, the job replaces it on a spare. Nodes found bad by earlier runs of
the same job (remembered in ``<workdir>/.planaria``) are excluded.

No config string or path becomes code, for the shell or for sbatch. The shell part (``cd`` to
where the submission was made, ``exec planaria run``) quotes every word. ``#SBATCH`` lines are
read by sbatch by its own rules (whitespace splits, quotes, backslashes and ``#`` are its
syntax, ``%`` is a pattern in a file name), so what goes there is one plain word, checked by
the options model or here, and anything else is refused naming its field and the character.
The working directory is no ``#SBATCH`` line at all: sbatch takes its own, where it runs.

The master runs on the batch host, which nobody knows at submission: the script asks
:mod:`planaria_slurm.address` for that host's address towards the allocation's nodes when it
runs, and exports it as ``PLANARIA_MASTER_ADVERTISE`` (unset when it cannot tell), which a
master bound to every interface with no ``master.advertise`` tells its agents. The address is
a value the shell expands, never re-reads: no answer becomes code either.
"""

from __future__ import annotations

import os
import shlex
import string
import tempfile
from pathlib import Path

from planaria.errors import ConfigError, ConfigIssue
from planaria.master.advertise import ADVERTISE_ENV
from planaria.plugin import SchedulerError, SubmitRequest, SubmitResult
from planaria_slurm import commands, state
from planaria_slurm.options import SlurmOptions

STATE_DIR = ".planaria"

PLAIN = frozenset(string.ascii_letters + string.digits + "_.,:=+@/[]-")
"""What sbatch reads literally in an ``#SBATCH`` value, whatever its version and locale."""


def state_dir(options: SlurmOptions, request: SubmitRequest) -> Path:
    if options.state_dir is not None:
        return (
            options.state_dir
            if options.state_dir.is_absolute()
            else (request.directory / options.state_dir)
        )
    return request.workdir / STATE_DIR


def script(options: SlurmOptions, request: SubmitRequest) -> str:
    """The batch script (its text); see the module docstring. Raises
    :class:`~planaria.errors.ConfigError` for a value it cannot carry."""
    where = state_dir(options, request)
    where_field = "job.workdir" if options.state_dir is None else "scheduler.options.state_dir"
    job = _plain(request.job, "job.name", "job-name")
    output = _plain(
        str(where),
        where_field,
        "output",
        " (the batch job's output goes there: scheduler.options.state_dir can be such a path)",
    )
    bad = sorted(state.load(where))
    for node in bad:
        _plain(node, f"{where / state.BAD_NODES} (a node remembered bad)", "exclude")
    lines = [
        "#!/bin/sh",
        f"#SBATCH --job-name={job}",
        f"#SBATCH --nodes={request.max_nodes + request.standby + options.spares}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --no-kill",
        f"#SBATCH --output={output}/slurm-%j.out",
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
    directory = _word(str(request.directory), "the directory `planaria submit` ran in")
    run = [
        _word(request.python, "the Python that runs `planaria run`"),
        "-m",
        "planaria",
        "run",
        _word(str(request.config), "the config file"),
        *[arg for override in request.overrides for arg in ("--set", _word(override, "--set"))],
        "--set",
        _word(f"scheduler.options.state_dir={where}", where_field),
    ]
    address = [run[0], "-m", "planaria_slurm.address"]
    lines += [
        "",
        f"# Written by planaria submit: job {job}, {request.min_nodes}-"
        f"{request.max_nodes} node(s) of {request.procs_per_node} worker(s), "
        f"{request.standby} standing by, {options.spares} spare(s).",
        f"cd -- {shlex.quote(directory)} || exit 1",
        "# The master runs here, on the batch host: this host's address that the allocation's",
        "# nodes reach, for its agents where master.host binds every interface and",
        "# master.advertise is not set.",
        f"if {ADVERTISE_ENV}=$({shlex.join(address)}); then",
        f"    export {ADVERTISE_ENV}",
        "else",
        f"    unset {ADVERTISE_ENV}",
        "fi",
        f"exec {shlex.join(run)}",
        "",
    ]
    return "\n".join(lines)


def _plain(value: str, field: str, flag: str, hint: str = "") -> str:
    """``value`` as it goes into ``#SBATCH --flag=``: one plain word, else refused."""
    wrong = next((c for c in value if c not in PLAIN), None) if value else ""
    if wrong is not None:
        what = "is empty" if wrong == "" else f"holds {wrong!r}"
        raise ConfigError(
            [
                ConfigIssue(
                    field,
                    f"{value!r} {what}, which #SBATCH --{flag} cannot carry as written (sbatch "
                    "splits its lines at whitespace, reads quotes, backslashes, '#' and '%' "
                    f"itself): use letters, digits and _.,:=+@/[]- only{hint}",
                )
            ]
        )
    return value


def _word(value: str, field: str) -> str:
    """``value`` as it goes into the script's shell part, quoted: anything but NUL, which no
    shell word holds, and CR, which sbatch takes for a DOS line break."""
    wrong = next((c for c in value if c in "\0\r"), None)
    if wrong is not None:
        raise ConfigError(
            [ConfigIssue(field, f"{value!r} holds {wrong!r}, which a batch script cannot carry")]
        )
    return value


def submit(options: SlurmOptions, request: SubmitRequest, *, dry_run: bool) -> SubmitResult:
    text = script(options, request)
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
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(text)
        # sbatch's own working directory is the job's: a path it takes as it is.
        job_id = commands.run(["sbatch", "--parsable", path], cwd=request.directory)
        job_id = job_id.strip().split(";")[0]
    finally:
        os.unlink(path)  # sbatch keeps its own copy
    if not job_id:
        raise SchedulerError("sbatch printed no job id")
    return SubmitResult(script=text, job_id=job_id)
