"""``planaria check``: run the configured health checks on this node; with ``--preflight``, the
pre-flight node check on the nodes the job would get (:mod:`planaria.master.preflight`)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from planaria.cli.app import EXIT_UNHEALTHY, ConfigOption, JsonOption, SetOption, app, load_job
from planaria.cli.output import err, out, print_json, styled
from planaria.config import ResolvedConfig
from planaria.errors import ConfigError, PlanariaError
from planaria.health.api import CheckContext, CheckResult, NodeHealth
from planaria.health.runner import run_checks
from planaria.plugin.manager import PluginManager


def _context(workdir: Path) -> CheckContext:
    return CheckContext(node=socket.gethostname(), workdir=workdir.absolute())


def _table(health: NodeHealth) -> Table:
    table = Table(title=f"health of {health.node}")
    for column in ("check", "device", "status", "detail"):
        table.add_column(column, overflow="fold")
    for result in health.checks:
        if result.error is not None or not result.devices:
            table.add_row(result.check, "-", styled(result.status), result.error or "no devices")
        for device in result.devices:
            table.add_row(result.check, device.device, styled(device.status), device.detail)
    return table


PreflightOption = Annotated[
    bool,
    typer.Option(
        "--preflight",
        help="instead: get the job's nodes from its scheduler and run the pre-flight node "
        "check on them, without training",
    ),
]


def _preflight(resolved: ResolvedConfig, manager: PluginManager, json: bool) -> None:
    import asyncio

    from planaria.cli.follow import HOOKS, print_preflight
    from planaria.master.prepare import preflight_issues, scheduler_issues
    from planaria.master.runner import run_job

    issues = preflight_issues(resolved, asked=True) + scheduler_issues(resolved)
    if issues:
        raise ConfigError(issues, resolved.source)
    summary, run_dir = asyncio.run(run_job(resolved, manager, preflight_only=True, hooks=HOOKS))
    report = summary.preflight
    if json and report is None:
        print_json({"healthy": False, "result": summary.reason})
    elif json and report is not None:
        print_json(
            {
                "healthy": summary.state == "succeeded",
                "result": summary.reason,
                "nodes": report.nodes,
                "rounds": report.rounds,
                "baseline": report.baseline,
                "slowest": {
                    measure: {"node": node, "seconds": seconds}
                    for measure, (node, seconds) in report.slowest.items()
                },
                "verdicts": [
                    {
                        "node": v.node,
                        "host": report.hosts.get(v.node),
                        "verdict": v.kind,
                        "round_1": v.first,
                        "detail": v.detail,
                    }
                    for v in report.verdicts
                ],
                "timeline": str(run_dir / "events.jsonl"),
            }
        )
    else:
        if report is not None:
            print_preflight(report)
        out.print(f"{summary.state}: {summary.reason}")
        out.print(f"timeline: {run_dir / 'events.jsonl'}\nlogs: {run_dir / 'logs'}")
    if summary.state != "succeeded":
        raise SystemExit(EXIT_UNHEALTHY)


def _error_json(exc: PlanariaError) -> dict[str, object]:
    problems = [
        {"path": i.path, "line": i.line, "set": i.override, "message": i.message}
        for i in (exc.issues if isinstance(exc, ConfigError) else [])
    ]
    return {"healthy": False, "error": str(exc), "problems": problems}


@app.command("check")
def check_command(
    config: ConfigOption = None,
    set_: SetOption = None,
    json: JsonOption = False,
    preflight: PreflightOption = False,
) -> None:
    """Run the configured health checks (default: host) on this node; or, with --preflight,
    the pre-flight node check on as many nodes as the job asks of its scheduler.

    Exit 0 if healthy, 1 if any check failed or could not run (with --preflight: a node was
    faulty or slow, or the check could not run), 2 on a config error.
    """
    try:
        resolved, manager = load_job(config, set_)
    except PlanariaError as exc:
        if json:  # a script reading stdout gets an answer it can parse, with every problem
            print_json(_error_json(exc))
        raise
    if preflight:
        _preflight(resolved, manager, json)
        return
    context = _context(resolved.config.job.workdir)
    done: list[CheckResult] = []
    if json or not err.is_terminal:
        health = run_checks(resolved.checks, context)
    else:
        with err.status(f"running {len(resolved.checks)} health check(s)") as status:

            def progress(result: CheckResult) -> None:
                done.append(result)
                status.update(f"{len(done)}/{len(resolved.checks)} checks done")

            health = run_checks(resolved.checks, context, on_result=progress)
    if json:
        print_json({**health.model_dump(mode="json"), "healthy": health.healthy})
    else:
        out.print(_table(health))
        verdict = "[green]healthy[/]" if health.healthy else "[bold red]unhealthy[/]"
        out.print(f"{health.node}: {verdict} ({len(health.checks)} check(s))")
    if not health.healthy:
        raise SystemExit(EXIT_UNHEALTHY)
