"""``planaria kubernetes ...``: the kubernetes scheduler's own commands."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml

from planaria.errors import ConfigError, ConfigIssue

commands = typer.Typer(
    help="Run jobs on Kubernetes: what to apply to a cluster.", no_args_is_help=True
)


@commands.command("manifest")
def manifest(
    config: Annotated[Path, typer.Argument(help="the job's config file (YAML or TOML)")],
    set_: Annotated[
        Optional[list[str]],  # noqa: UP045 - typer needs Optional at runtime on Python 3.10
        typer.Option("--set", metavar="PATH=VALUE", help="override a config value"),
    ] = None,
    python: Annotated[
        str, typer.Option(help="the interpreter in the image that runs planaria")
    ] = "python",
) -> None:
    """Print the manifests that run the job on Kubernetes, for `kubectl apply -f -`: its
    config as a ConfigMap, the master as a Job, and the master's ServiceAccount with the
    least rights it needs. Nothing is sent to a cluster."""
    from planaria.config.loader import read, validate
    from planaria.config.resolve import resolve
    from planaria.plugin.manager import PluginManager
    from planaria_kubernetes.manifest import check, manifests
    from planaria_kubernetes.options import KubernetesOptions
    from planaria_kubernetes.pods import as_dict

    raw = read(config, set_ or [])
    manager = PluginManager.from_entry_points()
    resolved = resolve(validate(raw, manager), manager, raw.source)
    scheduler = resolved.backends.get("scheduler")
    if scheduler is None or not isinstance(scheduler.options, KubernetesOptions):
        backend = resolved.config.scheduler.backend
        raise ConfigError(
            [
                ConfigIssue(
                    "scheduler.backend", f"is {backend!r}: the manifests are for `kubernetes`"
                )
            ],
            raw.source,
        )
    # The config the master reads in its pod: as given, with the overrides applied, less
    # what points into this machine (in its pod, the master uses the in-cluster config).
    data = copy.deepcopy(raw.data)
    for key in ("kubeconfig", "context"):
        data.get("scheduler", {}).get("options", {}).pop(key, None)
    text = yaml.safe_dump(data, sort_keys=False)
    objects = [
        as_dict(m)
        for m in manifests(resolved.config.job.name, text, scheduler.options, python=python)
    ]
    problems = check(objects)
    if problems:  # a bug of this command, never of the user's config
        raise RuntimeError("invalid manifests: " + "; ".join(problems))
    typer.echo(yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False), nl=False)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the job's config in its ConfigMap) as literal blocks."""


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _string)
