"""What a valid config asks of this machine, checked before a job starts: the directory it runs
in, and, where the nodes are this machine, the program it runs.

The schema cannot know these: they depend on the files here. Where a scheduler's nodes are
other machines (:attr:`planaria.scheduler.api.Scheduler.nodes_here` false), the program may exist
only there (a container image, a module loaded on the nodes), so it is not looked for here; a
worker that cannot start there is reported by its agent with the system's reason, and the job
stops.
"""

from __future__ import annotations

import os
from pathlib import Path

from planaria.agent.program import find_program, parse_python_command
from planaria.config.resolve import ResolvedConfig
from planaria.errors import ConfigIssue
from planaria.scheduler.api import Scheduler


def nodes_here(resolved: ResolvedConfig) -> bool:
    scheduler = resolved.backends.get("scheduler")
    factory = None if scheduler is None else scheduler.record.factory
    return isinstance(factory, type) and issubclass(factory, Scheduler) and factory.nodes_here


def workdir_issues(resolved: ResolvedConfig) -> list[ConfigIssue]:
    """The workdir must exist where it is used: on this machine when the nodes are here, or
    when the run directory is inside it (the master writes there)."""
    job = resolved.config.job
    if job.run_dir.is_absolute() and not nodes_here(resolved):
        return []
    workdir = job.workdir.expanduser().absolute()
    if not workdir.exists():
        why = "does not exist"
    elif not workdir.is_dir():
        why = "is not a directory"
    else:
        return []
    return [
        resolved.issue(
            "job.workdir",
            f"{workdir} {why}: the job runs in it; create it, or set job.workdir to the "
            "directory the training command runs in",
        )
    ]


def program_issues(resolved: ResolvedConfig) -> list[ConfigIssue]:
    """The training command's program (and a Python script it runs), as a worker here would
    look for them: relative to the workdir, on the ``PATH`` it gets."""
    job = resolved.config.job
    if not job.command or not nodes_here(resolved):
        return []
    workdir = job.workdir.expanduser().absolute()
    path = job.env.get("PATH", os.environ.get("PATH", os.defpath))
    program = job.command[0]
    if find_program(program, workdir, path) is None:
        if os.path.isabs(program):
            where = ""
        elif os.sep in program:
            where = f" in {workdir} (job.workdir)"
        else:
            where = " on the PATH the workers get (set it in job.env, or give the path)"
        return [resolved.issue("job.command", f"{program!r} is not an executable file{where}")]
    python = parse_python_command(job.command)
    if python is not None and python.kind == "script":
        script = workdir / Path(python.target).expanduser()
        if not script.exists():
            return [
                resolved.issue(
                    "job.command",
                    f"the script {python.target!r} does not exist in {workdir}: the job runs "
                    "there (job.workdir)",
                )
            ]
    return []


def machine_issues(resolved: ResolvedConfig) -> list[ConfigIssue]:
    issues = workdir_issues(resolved)
    return issues or program_issues(resolved)
