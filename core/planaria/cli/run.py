"""``planaria run``: start the master, get the nodes, train, recover, summarise."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from pathlib import Path
from typing import Annotated, Optional

import typer

from planaria import log
from planaria.cli.app import EXIT_USAGE, ConfigOption, SetOption, app, configure_logging
from planaria.cli.follow import HOOKS, print_summary
from planaria.cli.launch import (
    LaunchError,
    LocalRanksFilterOption,
    LogDirOption,
    MasterAddrOption,
    MasterPortOption,
    MaxRestartsOption,
    ModuleOption,
    MonitorOption,
    NnodesOption,
    NodeRankOption,
    NoPythonOption,
    NprocOption,
    RdzvBackendOption,
    RdzvEndpointOption,
    RdzvIdOption,
    RedirectsOption,
    ShutdownOption,
    StandaloneOption,
    TeeOption,
    TorchrunFlags,
    training_command,
)
from planaria.cli.line import META_LITERAL, RunCommand
from planaria.cli.output import error, out, warning
from planaria.cli.rendezvous import Launcher, LauncherError, external_plugins, join
from planaria.config import ResolvedConfig, load_raw, read
from planaria.errors import ConfigError
from planaria.master.diagnosis import stopped_on_start
from planaria.master.journal import JournalError
from planaria.master.prepare import run_issues
from planaria.master.runner import resume_job, run_job
from planaria.master.state import JobState
from planaria.plugin.manager import PluginManager
from planaria.protocol import FINGERPRINT_ENV, MASTER_ENV, TOKEN_ENV


def _prepare(
    file: Path | None,
    overrides: list[str],
    chaos: list[str],
    command: list[str],
    flags: TorchrunFlags | None = None,
) -> tuple[ResolvedConfig, PluginManager]:
    raw = read(file, overrides)
    if flags is not None:
        flags.apply(raw)
    if chaos:
        raw.data["chaos"] = [*(raw.data.get("chaos") or []), *chaos]
    if command:
        job = raw.data.setdefault("job", {})
        if isinstance(job, dict):
            job["command"] = command
    configure_logging(raw)
    resolved, manager = load_raw(raw, external_plugins(raw))
    issues = run_issues(resolved)
    if issues:
        raise ConfigError(issues, raw.source)
    return resolved, manager


Command = Annotated[
    Optional[list[str]],  # noqa: UP045
    typer.Argument(
        metavar="[SCRIPT [ARGS]... | -- COMMAND...]",
        help="the training script and its arguments, run by this Python as torchrun runs "
        "them; or, after --, a command run as written. Either overrides job.command",
        show_default=False,
    ),
]
ChaosOption = Annotated[
    Optional[list[str]],  # noqa: UP045
    typer.Option(
        "--chaos",
        metavar="RULE",
        help='inject a fault, e.g. --chaos "kill_worker rank=1 at_step=20" (repeatable)',
        show_default=False,
    ),
]


ResumeOption = Annotated[
    Optional[Path],  # noqa: UP045
    typer.Option(
        "--resume",
        metavar="RUN_DIR",
        help="take over the job of RUN_DIR whose master died: its agents keep training for "
        "master.grace and re-attach (no config file then)",
        show_default=False,
    ),
]


@app.command(
    "run",
    cls=RunCommand,
    context_settings={"help_option_names": ["-h", "--help"]},
)
def run_command(
    ctx: typer.Context,
    file: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Argument(
            metavar="[JOB.yaml]", help="job config file (YAML or TOML)", show_default=False
        ),
    ] = None,
    command: Command = None,
    config: ConfigOption = None,
    set_: SetOption = None,
    chaos: ChaosOption = None,
    resume: ResumeOption = None,
    nnodes: NnodesOption = None,
    nproc_per_node: NprocOption = None,
    max_restarts: MaxRestartsOption = None,
    rdzv_id: RdzvIdOption = None,
    master_addr: MasterAddrOption = None,
    master_port: MasterPortOption = None,
    log_dir: LogDirOption = None,
    redirects: RedirectsOption = None,
    tee: TeeOption = None,
    local_ranks_filter: LocalRanksFilterOption = None,
    shutdown_timeout: ShutdownOption = None,
    monitor_interval: MonitorOption = None,
    module: ModuleOption = False,
    no_python: NoPythonOption = False,
    standalone: StandaloneOption = False,
    rdzv_endpoint: RdzvEndpointOption = None,
    rdzv_backend: RdzvBackendOption = None,
    node_rank: NodeRankOption = None,
) -> None:
    """Run a training job: master, nodes, rendezvous, supervision and recovery.

    With a job file (planaria run job.yaml), or torchrun's way without one: planaria run
    --nnodes 2 --nproc-per-node 4 train.py --lr 0.1. torchrun's flags override the file's
    fields; everything after the script is the script's.

    Exit 0 only if the training command succeeded; 2 for a bad config or command line, and
    for workers that cannot start; 130 or 143 when SIGINT or SIGTERM stopped the job (128 +
    the signal's number, as a shell reports it), 1 for any other failure.
    """
    del standalone  # a job is standalone unless its scheduler says otherwise
    flags = TorchrunFlags(
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        max_restarts=max_restarts,
        rdzv_id=rdzv_id,
        master_addr=master_addr,
        master_port=master_port,
        log_dir=log_dir,
        redirects=redirects,
        tee=tee,
        local_ranks_filter=local_ranks_filter,
        shutdown_timeout=shutdown_timeout,
        module=module,
        no_python=no_python,
    )
    if file is not None and config is not None:
        error(f"give the job file once: {file} and --config {config}")
        raise SystemExit(EXIT_USAGE)
    file = file or config
    literal = bool(ctx.meta.get(META_LITERAL))
    interrupted: list[signal.Signals] = []
    hooks = dataclasses.replace(HOOKS, on_interrupt=interrupted.append)
    try:
        command = training_command(command or [], flags, literal)
    except LaunchError as exc:
        error(str(exc))
        raise SystemExit(EXIT_USAGE) from None
    if monitor_interval is not None:
        warning("--monitor-interval is ignored: the agent watches its workers every 20 ms")
    if rdzv_endpoint is not None or node_rank is not None:
        try:
            launcher = Launcher.from_line(
                rdzv_endpoint, rdzv_backend, node_rank, other=(resume, master_addr, master_port)
            )
        except (LauncherError, OSError) as exc:
            error(str(exc))
            raise SystemExit(EXIT_USAGE) from None
        raw_set = [*(set_ or []), *launcher.settings()]
        if not launcher.is_master:
            raise SystemExit(join(launcher, file, raw_set))
        token = launcher.token
        resolved, manager = _prepare(file, raw_set, chaos or [], command, flags)
        summary, run_dir = asyncio.run(run_job(resolved, manager, hooks=hooks, token=token))
    elif resume is not None:
        if file is not None or command or set_ or chaos or flags.given():
            error(
                "--resume takes the job as it was journalled: give no config, command, --set, "
                "--chaos or torchrun flags"
            )
            raise SystemExit(EXIT_USAGE)
        try:
            summary, run_dir = asyncio.run(resume_job(resume, hooks=hooks))
        except JournalError as exc:
            error(str(exc))
            raise SystemExit(EXIT_USAGE) from None
    elif file is None and not command:
        error("give a job config file, a training script (torchrun's way), or --resume RUN_DIR")
        raise SystemExit(EXIT_USAGE)
    else:
        resolved, manager = _prepare(file, set_ or [], chaos or [], command, flags)
        if resolved.config.scheduler.backend == "external":
            error(
                "scheduler 'external' runs nodes started outside planaria, each by `planaria "
                "run --rdzv-endpoint HOST:PORT ...` with the same PLANARIA_TOKEN: start the job "
                "that way on every node"
            )
            raise SystemExit(EXIT_USAGE)
        summary, run_dir = asyncio.run(run_job(resolved, manager, hooks=hooks))
    print_summary(summary, run_dir)
    _write_report(run_dir)
    if summary.state != JobState.SUCCEEDED.value:
        if interrupted:  # a requeue wrapper tells a stop it asked for from a crash
            raise SystemExit(128 + interrupted[0])
        raise SystemExit(EXIT_USAGE if stopped_on_start(summary) else 1)


def _write_report(run_dir: Path) -> None:
    """Every run gets its report page; one that cannot be made is a warning, never another
    exit code for the job."""
    try:
        from planaria.report import write_report

        path = write_report(run_dir)
    except Exception as exc:
        warning(f"no report written: {exc}")
        return
    out.print(f"report: {path}", markup=False, highlight=False)


@app.command("agent", hidden=True)
def agent_command(
    master: Annotated[Optional[str], typer.Option(envvar=MASTER_ENV)] = None,  # noqa: UP045
    node_id: Annotated[Optional[str], typer.Option(envvar="PLANARIA_NODE_ID")] = None,  # noqa: UP045
    host: Annotated[Optional[str], typer.Option(envvar="PLANARIA_HOST")] = None,  # noqa: UP045
) -> None:
    """Run this node's agent (started by the scheduler; the token comes in PLANARIA_TOKEN,
    the fingerprint of the master's certificate in PLANARIA_MASTER_FINGERPRINT)."""
    from planaria.agent.main import main as agent_main

    # Out of the environment: nothing this agent starts (workers, the warm interpreter, the
    # persister) talks to the master, so nothing it starts gets the job's token.
    token = os.environ.pop(TOKEN_ENV, None)
    fingerprint = os.environ.pop(FINGERPRINT_ENV, None) or None
    if not master or not token or not node_id:
        error(f"the agent needs {MASTER_ENV}, {TOKEN_ENV} and PLANARIA_NODE_ID")
        raise SystemExit(2)
    log.bind(component="agent")
    raise SystemExit(asyncio.run(agent_main(master, token, node_id, host or node_id, fingerprint)))
