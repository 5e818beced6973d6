"""The ``planaria`` command: every command module registered on the app, and its errors.

Commands import the app from :mod:`planaria.cli.app`; only this module imports the commands,
so that none of them depends on another through the app.
"""

from __future__ import annotations

import sys

from planaria.cli import (  # noqa: F401 - registers
    api_schema,
    check,
    config_cmd,
    plugins,
    report_cmd,
    run,
    status_cmd,
    submit,
)
from planaria.cli.app import EXIT_USAGE, app
from planaria.cli.output import error
from planaria.errors import PlanariaError
from planaria.plugin.records import PluginKind, normalize_name
from planaria.scheduler.api import SchedulerRecord


def _scheduler_commands(argv: list[str]) -> None:
    """``planaria <scheduler> ...``: a scheduler plugin's own commands join the app when the
    first argument names an installed scheduler that has some (only then are plugins loaded)."""
    if len(argv) < 2 or argv[1].startswith("-"):
        return
    known = {c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands}
    known |= {g.name or "" for g in app.registered_groups}
    name = argv[1]
    if name in known:
        return
    from planaria.plugin.manager import PluginManager

    manager = PluginManager.from_entry_points()
    key = normalize_name(name)
    record = manager.records(PluginKind.SCHEDULER).get(key)
    if record is None and key in SchedulerRecord.well_known_commands:
        # Not installed, blocked or broken: resolve says which, and what to install.
        try:
            manager.resolve(PluginKind.SCHEDULER, name)
        except PlanariaError as exc:
            raise PlanariaError(
                f"'planaria {name}' comes with the {name} scheduler: {exc}"
            ) from None
    commands = getattr(record, "commands", None)
    if commands is not None:
        app.add_typer(commands, name=name)


def main() -> None:
    """Entry point of the ``planaria`` command: planaria's own errors print without a
    traceback and exit 2."""
    try:
        _scheduler_commands(sys.argv)
        app()
    except PlanariaError as exc:
        error(str(exc))
        sys.exit(EXIT_USAGE)
