"""``planaria plugins``: every plugin, where it comes from, its status and what it registers."""

from __future__ import annotations

from collections import Counter

from rich.markup import escape
from rich.table import Table

from planaria.cli.app import EXIT_USAGE, ConfigOption, JsonOption, app
from planaria.cli.output import error, out, print_json
from planaria.config import read
from planaria.config.loader import disabled_plugins
from planaria.errors import PluginError
from planaria.fault_pattern.api import FaultPattern
from planaria.plugin.manager import PluginManager, PluginStatus

_STATUS_STYLE = {
    PluginStatus.LOADED: "green",
    PluginStatus.BLOCKED: "yellow",
    PluginStatus.FAILED: "bold red",
}


@app.command("plugins")
def plugins_command(config: ConfigOption = None, json: JsonOption = False) -> None:
    """List installed plugins: kinds, distribution and version, status, records and fault
    patterns."""
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
            lines = [f"[bold]{r.name}[/] ({r.kind.label}): {r.summary}" for r in info.records]
            if info.fault_patterns:
                lines.append(_patterns_line(info.fault_patterns))
            records = "\n".join(lines)
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


def _patterns_line(patterns: list[FaultPattern]) -> str:
    """``23 fault patterns (node 16, transient 4, user 3)``: a vendor's list is long, and
    ``--json`` holds every one; a single pattern shows its reason."""
    if len(patterns) == 1:
        (only,) = patterns
        return f"[bold]1 fault pattern[/] ({only.kind}): {escape(only.label)}"
    counts = Counter(p.kind for p in patterns)
    per_kind = ", ".join(f"{kind} {counts[kind]}" for kind in sorted(counts))
    return f"[bold]{len(patterns)} fault patterns[/] ({per_kind})"
