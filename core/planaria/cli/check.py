"""``planaria check``: run the configured health checks on this node."""

from __future__ import annotations

import socket
from pathlib import Path

from rich.table import Table

from planaria.checks.runner import run_checks
from planaria.cli.app import EXIT_UNHEALTHY, ConfigOption, JsonOption, SetOption, app, load_job
from planaria.cli.output import err, out, print_json, styled
from planaria.health import CheckContext, CheckResult, NodeHealth


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


@app.command("check")
def check_command(
    config: ConfigOption = None, set_: SetOption = None, json: JsonOption = False
) -> None:
    """Run the configured health checks (default: host) on this node.

    Exit 0 if healthy, 1 if any check failed or could not run, 2 on a config error.
    """
    resolved, _ = load_job(config, set_)
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
