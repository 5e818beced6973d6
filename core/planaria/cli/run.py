"""``planaria run``: start the master, get the nodes, train, recover, summarise."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import textwrap
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.live import Live
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from planaria import log
from planaria.agent.console import prefix
from planaria.cli.app import EXIT_USAGE, ConfigOption, SetOption, app, configure_logging
from planaria.cli.launch import (
    META_LITERAL,
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
    RunCommand,
    ShutdownOption,
    StandaloneOption,
    TeeOption,
    TorchrunFlags,
    training_command,
)
from planaria.cli.output import error, out, warning
from planaria.cli.rendezvous import Launcher, LauncherError, external_plugins, join
from planaria.config import ResolvedConfig, load_raw, read
from planaria.diagnosis.preflight import PreflightReport
from planaria.errors import ConfigError
from planaria.events import EventKind, JobEvent
from planaria.master.advertise import Advertised
from planaria.master.diagnosis import stopped_on_start
from planaria.master.job import Master
from planaria.master.journal import JournalError
from planaria.master.prepare import run_issues
from planaria.master.runner import RunHooks, resume_job, run_job
from planaria.master.state import JobState
from planaria.master.summary import Summary
from planaria.master.tables import (
    FAULT_COLUMNS,
    STRAGGLER_COLUMNS,
    fault_rows,
    straggler_rows,
    summary_rows,
)
from planaria.plugin.manager import PluginManager
from planaria.protocol import FINGERPRINT_ENV, MASTER_ENV, TOKEN_ENV, JobSpec, WorkersOutput

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
