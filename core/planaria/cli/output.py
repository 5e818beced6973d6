"""Terminal output shared by the commands: consoles, status colours, JSON printing."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape

from planaria.health.api import Status

# soft_wrap: a message is never broken at the terminal's width, so pipes and grep see it whole.
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

STATUS_STYLE = {
    Status.OK: "green",
    Status.NOT_APPLICABLE: "dim",
    Status.DEGRADED: "yellow",
    Status.FAILED: "bold red",
    Status.ERROR: "bold magenta",
}


def styled(status: Status) -> str:
    return f"[{STATUS_STYLE[status]}]{status.value}[/]"


def print_json(data: Any) -> None:
    """Plain JSON on stdout, never wrapped or coloured, so that pipes can parse it."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def error(message: str) -> None:
    # Escaped: a message quotes the user's values, and "[x, y]" is no markup of ours.
    err.print(f"[bold red]error:[/] {escape(message)}", markup=True, highlight=False)


def warning(message: str) -> None:
    err.print(f"[bold yellow]warning:[/] {escape(message)}", markup=True, highlight=False)
