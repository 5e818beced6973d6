"""``planaria config validate|show|schema``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
import yaml

from planaria.cli.app import SetOption, app, load_job
from planaria.cli.output import out, print_json
from planaria.config.schema import config_schema
from planaria.plugin.manager import PluginManager

config_app = typer.Typer(help="Validate, show and describe job config files.", no_args_is_help=True)
app.add_typer(config_app, name="config")

FileArgument = Annotated[Path, typer.Argument(help="job config file (YAML or TOML)")]


@config_app.command("validate")
def validate(file: FileArgument, set_: SetOption = None) -> None:
    """Check FILE, including every plugin's options; all problems are listed together.
    A cluster manager (Slurm, Ray, Kubernetes) is not asked: `planaria run` and `planaria
    submit` ask it whether it has what the file names (a partition, the nodes)."""
    resolved, _ = load_job(file, set_, ask_cluster=False)
    checks = ", ".join(c.name for c in resolved.checks) or "none"
    out.print(f"{file}: valid (job {resolved.config.job.name!r}; health checks: {checks})")


@config_app.command("show")
def show(
    file: FileArgument,
    set_: SetOption = None,
    json: Annotated[bool, typer.Option("--json", help="print JSON instead of YAML")] = False,
) -> None:
    """Print FILE as planaria reads it: overrides applied, every default filled in."""
    resolved, _ = load_job(file, set_, ask_cluster=False)
    data = resolved.dump()
    if json:
        print_json(data)
    else:
        typer.echo(yaml.safe_dump(data, sort_keys=False), nl=False)


@config_app.command("schema")
def schema() -> None:
    """Print the JSON Schema of the config file, with every installed plugin's options."""
    print_json(config_schema(PluginManager.from_entry_points()))
