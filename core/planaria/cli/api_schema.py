"""``planaria api-schema``: the OpenAPI document of the master's API."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from planaria.cli.app import EXIT_USAGE, app
from planaria.cli.output import error, out
from planaria.master import openapi


@app.command("api-schema")
def api_schema(
    output: Annotated[
        Optional[Path],  # noqa: UP045 - typer needs Optional at runtime on Python 3.10
        typer.Option("--output", "-o", help="write it to FILE instead", show_default=False),
    ] = None,
) -> None:
    """Print the OpenAPI 3.1 document of the master's API (JSON): every route, its request and
    reply schemas, its errors, and the token it needs."""
    text = openapi.dumps()
    if output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        error(f"cannot write the API schema to {output}: {exc.strerror or exc}")
        raise SystemExit(EXIT_USAGE) from None
    out.print(f"wrote the master's API schema to {output}")
