"""torchrun's command line for ``planaria run``: ``planaria run --nnodes 1:2 --nproc-per-node 4
train.py --lr 0.1`` needs no job file, and a torchrun line moves over by changing one word.

Two things make this more than a few options:

- Everything from the training script on belongs to the script, as with torchrun: ``train.py
  --lr 0.1 -c x`` passes ``-c x`` to the script even though ``-c`` is also ours. Click would
  take options from anywhere on the line, so the line is cut before click sees it
  (:mod:`planaria.cli.line`).
- torchrun's flags mean what torchrun says they mean, mapped onto the job file's fields (they
  override the file's values when both are given); a torchrun flag that has no meaning here is
  refused with the reason, never ignored silently.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Optional

import typer
from pydantic import ValidationError

from planaria.agent.program import is_python
from planaria.config import RawConfig
from planaria.config.job import MAX_PROCS_PER_NODE, JobSection, LogsSection, NodeRange


def _spellings(*names: str) -> tuple[str, ...]:
    """A flag as torchrun takes it: ``--nproc-per-node`` and ``--nproc_per_node``."""
    out: list[str] = []
    for name in names:
        out.append(name)
        if name.startswith("--") and "-" in name[2:]:
            out.append("--" + name[2:].replace("-", "_"))
    return tuple(out)


# -- torchrun's flags ---------------------------------------------------------------------------


def _nnodes(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        NodeRange.model_validate(value)
    except ValidationError as exc:
        raise typer.BadParameter(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
    return value


def _nproc(value: str | None) -> str | None:
    if value is not None:
        resolve_nproc(value)  # fails early, with the flag's name
    return value


def _rdzv_id(value: str | None) -> str | None:
    if value is not None:
        try:
            JobSection.model_validate({"name": value})
        except ValidationError:
            raise typer.BadParameter(
                f"{value!r} is no job name: letters, digits, '_', '.' and '-', at most 63, "
                "starting with a letter or digit"
            ) from None
    return value


def resolve_nproc(value: str) -> int:
    """``--nproc-per-node`` as torchrun reads it: a number, ``cpu`` (this machine's CPUs),
    ``gpu`` (its CUDA devices) or ``auto`` (the GPUs if there are any, else the CPUs). Counted
    on the machine that runs ``planaria run``, which with the local scheduler is every node."""
    text = value.strip().lower()
    if text.isascii() and text.isdecimal():
        count = int(text[-7:]) if len(text) <= 7 else MAX_PROCS_PER_NODE + 1
    elif text in ("cpu", "gpu", "auto"):
        gpus = _cuda_devices() if text != "cpu" else 0
        if text == "gpu" and gpus == 0:
            raise typer.BadParameter("'gpu' asks for one worker per CUDA device; there is none")
        count = gpus or os.cpu_count() or 1
    else:
        raise typer.BadParameter(f"{value!r}: expected a number, or cpu, gpu or auto")
    if not 1 <= count <= MAX_PROCS_PER_NODE:
        raise typer.BadParameter(f"{value!r}: between 1 and {MAX_PROCS_PER_NODE} workers a node")
    return count


def _cuda_devices() -> int:
    if importlib.util.find_spec("torch") is None:
        return 0
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


NnodesOption = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option(
        "--nnodes",
        metavar="N|MIN:MAX",
        callback=_nnodes,
        help="nodes, or an elastic range (job.nodes)",
        show_default=False,
    ),
]
NprocOption = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option(
        *_spellings("--nproc-per-node"),
        metavar="N|cpu|gpu|auto",
        callback=_nproc,
        help="workers per node (job.procs_per_node)",
        show_default=False,
    ),
]
MaxRestartsOption = Annotated[
    Optional[int],  # noqa: UP045
    typer.Option(
        *_spellings("--max-restarts"),
        min=0,
        help="restarts before the job stops (job.max_restarts)",
        show_default=False,
    ),
]
RdzvIdOption = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option(
        *_spellings("--rdzv-id", "--run-id"),
        callback=_rdzv_id,
        help="the job's name (job.name)",
        show_default=False,
    ),
]
MasterAddrOption = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option(
        *_spellings("--master-addr"),
        help="address the job master binds, which agents reach (master.host)",
        show_default=False,
    ),
]
MasterPortOption = Annotated[
    Optional[int],  # noqa: UP045
    typer.Option(
        *_spellings("--master-port"),
        min=0,
        max=65535,
        help="the job master's port; 0 is any free port (master.port)",
        show_default=False,
    ),
]
LogDirOption = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option(
        *_spellings("--log-dir"),
        help="where each run gets a folder of its workers' logs (job.logs.dir)",
        show_default=False,
    ),
]


def _streams(value: str | None) -> str | None:
    if value is not None:
        try:
            LogsSection.model_validate({"redirects": value})
        except ValidationError as exc:
            raise typer.BadParameter(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
    return value


def _ranks(value: str | None) -> str | None:
    if value is not None:
        try:
            LogsSection.model_validate({"local_ranks_filter": value})
        except ValidationError as exc:
            raise typer.BadParameter(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
    return value


RedirectsOption = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option(
        "-r",
        *_spellings("--redirects"),
        metavar="0-3|RANK:0-3,...",
        callback=_streams,
        help="keep stdout (1), stderr (2) or both (3) off the console, in the log only; for "
        "every local rank or per local rank, e.g. 0:1,1:2 (job.logs.redirects)",
        show_default=False,
    ),
]
TeeOption = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option(
        "-t",
        "--tee",
        metavar="0-3|RANK:0-3,...",
        callback=_streams,
        help="show these streams on the console although redirected; the log has them "
        "anyway (job.logs.tee)",
        show_default=False,
    ),
]
LocalRanksFilterOption = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option(
        *_spellings("--local-ranks-filter"),
        metavar="RANK,...",
        callback=_ranks,
        help="show only these local ranks' output on the console (job.logs.local_ranks_filter)",
        show_default=False,
    ),
]
ShutdownOption = Annotated[
    Optional[float],  # noqa: UP045
    typer.Option(
        *_spellings("--shutdown-timeout"),
        min=0,
        help="seconds from SIGTERM to SIGKILL when workers stop (job.stop_grace)",
        show_default=False,
    ),
]
MonitorOption = Annotated[
    Optional[float],  # noqa: UP045
    typer.Option(
        *_spellings("--monitor-interval"),
        min=0,
        hidden=True,
        help="accepted for torchrun's lines; the agent watches its workers every 20 ms",
        show_default=False,
    ),
]
RdzvEndpointOption = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option(
        *_spellings("--rdzv-endpoint"),
        metavar="HOST:PORT",
        help="one launcher per node, started by srun, mpirun, ...: the one on HOST (or of "
        "--node-rank 0) is the job master, listening on PORT; the others join it. Needs "
        "PLANARIA_TOKEN, the same on every node",
        show_default=False,
    ),
]


def _backend(value: str | None) -> str | None:
    """Checked on every line, not only one with ``--rdzv-endpoint``: an ``etcd`` line must not
    run as if its backend were honoured."""
    from planaria.cli.rendezvous import BACKENDS

    if value is not None and value not in BACKENDS:
        raise typer.BadParameter(f"{value!r}: expected one of {', '.join(BACKENDS)}")
    return value


RdzvBackendOption = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option(
        *_spellings("--rdzv-backend"),
        metavar="c10d|static|planaria",
        callback=_backend,
        help="accepted for torchrun's lines: planaria's master forms every round",
        show_default=False,
    ),
]
NodeRankOption = Annotated[
    Optional[int],  # noqa: UP045
    typer.Option(
        *_spellings("--node-rank"),
        min=0,
        help="with --rdzv-endpoint: this node's rank (0 is the master's node; the master "
        "still orders the ranks of each round)",
        show_default=False,
    ),
]
ModuleOption = Annotated[
    bool, typer.Option("-m", "--module", help="run the script as python -m MODULE")
]
NoPythonOption = Annotated[
    bool,
    typer.Option(*_spellings("--no-python"), help="run the script itself, not with python"),
]
StandaloneOption = Annotated[
    bool,
    typer.Option(
        "--standalone",
        help="accepted for torchrun's lines: a job is standalone unless its scheduler says "
        "otherwise",
    ),
]


@dataclass(frozen=True)
class TorchrunFlags:
    """torchrun's flags as given (None: not given), and what each overrides."""

    nnodes: str | None = None
    nproc_per_node: str | None = None
    max_restarts: int | None = None
    rdzv_id: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    log_dir: str | None = None
    redirects: str | None = None
    tee: str | None = None
    local_ranks_filter: str | None = None
    shutdown_timeout: float | None = None
    module: bool = False
    no_python: bool = False

    def given(self) -> bool:
        return any(v not in (None, False) for v in vars(self).values())

    def overrides(self) -> dict[tuple[str, str], Any]:
        fields: dict[tuple[str, str], Any] = {
            ("job", "nodes"): self.nnodes,
            ("job", "procs_per_node"): None
            if self.nproc_per_node is None
            else resolve_nproc(self.nproc_per_node),
            ("job", "max_restarts"): self.max_restarts,
            ("job", "name"): self.rdzv_id,
            ("job", "stop_grace"): self.shutdown_timeout,
            ("master", "host"): self.master_addr,
            ("master", "port"): self.master_port,
        }
        return {path: value for path, value in fields.items() if value is not None}

    def log_overrides(self) -> dict[str, Any]:
        """The fields of ``job.logs`` they override."""
        fields = {
            "dir": self.log_dir,
            "redirects": self.redirects,
            "tee": self.tee,
            "local_ranks_filter": self.local_ranks_filter,
        }
        return {key: value for key, value in fields.items() if value is not None}

    def apply(self, raw: RawConfig) -> None:
        """Override the job file's fields (a section that is not a mapping is left for
        validation to report)."""
        for (section, key), value in self.overrides().items():
            node = raw.data.setdefault(section, {})
            if isinstance(node, dict):
                node[key] = value
        logs = self.log_overrides()
        job = raw.data.setdefault("job", {}) if logs else None
        if isinstance(job, dict):
            node = job.setdefault("logs", {})
            if isinstance(node, dict):
                node.update(logs)


class LaunchError(ValueError):
    """A training command that cannot be built from the line."""


def training_command(tail: Sequence[str], flags: TorchrunFlags, literal: bool) -> list[str]:
    """The job's command from what follows planaria's options: after ``--``, or a command that
    starts with a Python interpreter, as written; otherwise torchrun's ``script args...`` (or
    ``module args...`` with ``-m``, or ``program args...`` with ``--no-python``) run by this
    interpreter (``$PYTHON_EXEC`` if set, as torchrun does)."""
    if flags.module and flags.no_python:
        raise LaunchError("give -m/--module or --no-python, not both")
    if not tail:
        if flags.module or flags.no_python:
            raise LaunchError("-m/--module and --no-python need a training script after them")
        return []
    if literal or is_python(tail[0]):
        if flags.module or flags.no_python:
            raise LaunchError(
                "-m/--module and --no-python apply to a training script, not to a command "
                "given as written (after --, or starting with python)"
            )
        return list(tail)
    if flags.no_python:
        return list(tail)
    python = os.environ.get("PYTHON_EXEC") or sys.executable
    return [python, "-m", *tail] if flags.module else [python, *tail]
