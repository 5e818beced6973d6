"""The typer application and its shared options; the commands register on it in their own
modules, and :mod:`planaria.cli.entry` puts them together.

Exit codes: 0 success (a healthy node), 1 an unhealthy node, 2 a usage or configuration error.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Optional

import typer
from pydantic import ValidationError

from planaria import __version__, log
from planaria.config import RawConfig, ResolvedConfig, load_raw, read
from planaria.config.models import LoggingSection
from planaria.plugin.manager import PluginManager

EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE = 0, 1, 2

app = typer.Typer(
    name="planaria",
    help="Keep distributed training jobs running through faults.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


class _Settings:
    """Logging chosen on the command line wins over the config file's ``logging`` section."""

    log_format: str | None = None
    log_level: str | None = None


settings = _Settings()

ConfigOption = Annotated[
    Optional[Path],  # noqa: UP045 - typer needs Optional at runtime on Python 3.10
    typer.Option("--config", "-c", help="job config file (YAML or TOML)", show_default=False),
]
SetOption = Annotated[
    Optional[list[str]],  # noqa: UP045
    typer.Option(
        "--set",
        metavar="PATH=VALUE",
        help="override a config value, e.g. --set diagnosis.preflight=false (repeatable)",
        show_default=False,
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"planaria {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="print the version"),
    ] = False,
    log_format: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option("--log-format", help="console or json", show_default=False),
    ] = None,
    log_level: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option("--log-level", help="debug, info, warning or error", show_default=False),
    ] = None,
) -> None:
    if log_format not in (None, "console", "json"):
        raise typer.BadParameter("expected console or json", param_hint="--log-format")
    if log_level is not None and log_level.lower() not in log.LEVELS:
        raise typer.BadParameter(
            f"expected one of {', '.join(log.LEVELS)}", param_hint="--log-level"
        )
    settings.log_format, settings.log_level = log_format, log_level
    log.configure(log_format or "console", log_level or "info")  # type: ignore[arg-type]


def load_job(
    path: Path | None, overrides: list[str] | None, *, ask_cluster: bool = True
) -> tuple[ResolvedConfig, PluginManager]:
    """Read and validate a config (or the defaults), load the plugins it allows, resolve it;
    ``ask_cluster``: see :func:`planaria.config.resolve.load_raw`."""
    raw = read(path, overrides or [])
    configure_logging(raw)
    return load_raw(raw, ask_cluster=ask_cluster)


def configure_logging(raw: RawConfig) -> None:
    """Configure logging from the file before plugins load, so that their warnings follow it.
    A malformed logging section is reported by validation later."""
    with contextlib.suppress(ValidationError):
        logging = LoggingSection.model_validate(raw.data.get("logging") or {})
        log.configure(
            settings.log_format or logging.format,  # type: ignore[arg-type]
            settings.log_level or logging.level,
        )
