"""``planaria plugins``: every plugin, where it comes from, its status and what it registers."""

from __future__ import annotations

from rich.table import Table

from planaria.cli.app import EXIT_USAGE, ConfigOption, JsonOption, app
from planaria.cli.output import error, out, print_json
from planaria.config import read
from planaria.config.loader import disabled_plugins
from planaria.errors import PluginError
from planaria.plugin.manager import PluginManager, PluginStatus

_STATUS_STYLE = {
    PluginStatus.LOADED: "green",
    PluginStatus.BLOCKED: "yellow",
    PluginStatus.FAILED: "bold red",
}


@app.command("plugins")
def plugins_command(config: ConfigOption = None, json: JsonOption = False) -> None:
    """List installed plugins: kinds, distribution and version, status, records."""
    disable = disabled_plugins(read(config)) if config is not None else []
    manager = PluginManager.from_entry_points(disable=disable)
    conflict = None
    try:
        manager.check_duplicates()
    except PluginError as exc:
        conflict = str(exc)
    infos = sorted(manager.plugins.values(), key=lambda i: i.name)
    if json:
        print_json([info.to_json() for info in infos])
    else:
        table = Table(title="planaria plugins", show_lines=True)
        for column in ("plugin", "kinds", "distribution", "status", "records"):
            table.add_column(column, overflow="fold")
        for info in infos:
            status = f"[{_STATUS_STYLE[info.status]}]{info.status.value}[/]"
            if info.reason:
                status += f"\n{info.reason}"
            records = "\n".join(
                f"[bold]{r.name}[/] ({r.kind.label}): {r.summary}" for r in info.records
            )
            table.add_row(
                info.name,
                ", ".join(info.kinds),
                f"{info.distribution or '-'} {info.version or ''}".strip(),
                status,
                records,
            )
        out.print(table)
    if conflict:
        error(conflict)
        raise SystemExit(EXIT_USAGE)
