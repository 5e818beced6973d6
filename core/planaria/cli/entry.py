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


def main() -> None:
    """Entry point of the ``planaria`` command: planaria's own errors print without a
    traceback and exit 2."""
    try:
        app()
    except PlanariaError as exc:
        error(str(exc))
        sys.exit(EXIT_USAGE)
