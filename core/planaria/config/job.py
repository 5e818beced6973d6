"""The ``job`` section of the job file: the training command and its environment, how many
nodes and workers a node, and the workers' logs (torchrun's ``--redirects``, ``--tee`` and
``--local-ranks-filter`` among them). ``planaria run``'s torchrun-style flags fill the same
models (:mod:`planaria.cli.launch`)."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

from planaria.config.section import Section
from planaria.durations import Duration

MAX_NODES = 100_000
"""More nodes than any cluster has: the master is built for 10,000."""
MAX_PROCS_PER_NODE = 1024
"""More workers than any node has accelerators or cores; a scheduler bounds it further by
what its nodes have."""
MAX_ARG_STRLEN = 131072
"""Linux refuses to start a program given one argument or environment string longer than
this (32 pages), whatever ARG_MAX says."""


class NodeRange(BaseModel):
    """``nodes: 2`` (fixed) or ``nodes: "2:4"`` (elastic, min:max)."""

    model_config = ConfigDict(frozen=True)

    min: int = Field(ge=1, le=MAX_NODES)
    max: int = Field(ge=1, le=MAX_NODES)

    @model_validator(mode="before")
    @classmethod
    def _parse(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError('expected a node count such as 2, or a range "min:max" such as "2:4"')
        if isinstance(value, int):
            value = {"min": value, "max": value}
        elif isinstance(value, str):
            parts = value.split(":")
            if len(parts) not in (1, 2) or not all(re.fullmatch(r"\s*\d+\s*", p) for p in parts):
                raise ValueError(
                    f"invalid node count {value!r}: expected a number such as 2, or a range "
                    '"min:max" such as "2:4"'
                )
            digits = [p.strip().lstrip("0") or "0" for p in parts]
            if any(len(d) > len(str(MAX_NODES)) for d in digits):  # never parse 10**5000
                raise ValueError(f"at most {MAX_NODES} nodes, got {value!r}")
            value = {"min": int(digits[0]), "max": int(digits[-1])}
        if isinstance(value, dict) and any(
            isinstance(v, int) and v > MAX_NODES for v in value.values()
        ):
            raise ValueError(
                f"at most {MAX_NODES} nodes, got {NodeRange._text(value)}: more than any "
                "cluster has; ask for the nodes the job needs"
            )
        return value

    @staticmethod
    def _text(value: dict[str, Any]) -> str:
        low, high = value.get("min"), value.get("max")
        return str(low) if low == high else f"{low}:{high}"

    @model_validator(mode="after")
    def _ordered(self) -> NodeRange:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is greater than max ({self.max})")
        return self

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> dict[str, Any]:
        return {
            "anyOf": [
                {"type": "integer", "minimum": 1, "maximum": MAX_NODES},
                {"type": "string", "pattern": r"^\s*\d+\s*(:\s*\d+\s*)?$"},
            ],
            "description": 'number of nodes, or "min:max" for an elastic job',
        }

    @model_serializer
    def _as_text(self) -> str:
        return str(self)

    def __str__(self) -> str:
        return str(self.min) if self.min == self.max else f"{self.min}:{self.max}"


def _arg_max() -> int | None:
    try:
        limit = os.sysconf("SC_ARG_MAX")
    except (ValueError, OSError):
        return None
    return limit if limit > 0 else None


STREAMS = {0: "neither", 1: "stdout", 2: "stderr", 3: "both"}
"""torchrun's stream numbers for ``--redirects`` and ``--tee``."""


def parse_streams(value: Any) -> Any:
    """torchrun's ``--redirects``/``--tee`` value: ``3`` (every local rank), or a map of local
    ranks, ``"0:1,1:2"`` (ranks not named: 0), also written as a mapping."""
    if isinstance(value, bool):
        raise ValueError("expected 0-3 or a map of local ranks like '0:1,1:2'")
    if isinstance(value, str):
        text = value.strip()
        if ":" not in text:
            if not text.isdecimal():
                raise ValueError(f"{value!r}: expected 0-3 or a map of local ranks like '0:1,1:2'")
            return int(text)
        out: dict[int, int] = {}
        for part in text.split(","):
            rank, sep, streams = part.strip().partition(":")
            if not (sep and rank.strip().isdecimal() and streams.strip().isdecimal()):
                raise ValueError(f"{part.strip()!r} in {value!r}: expected LOCAL_RANK:STREAMS")
            out[int(rank)] = int(streams)
        return out
    return value


def parse_ranks(value: Any) -> Any:
    """``"0,1"`` as torchrun's ``--local-ranks-filter`` takes it, or a list."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        if not all(p.isdecimal() for p in parts):
            raise ValueError(f"{value!r}: expected local ranks like '0,1'")
        return [int(p) for p in parts]
    return value


StreamsValue = int | dict[int, int]


def _check_streams(value: StreamsValue) -> StreamsValue:
    values = value.values() if isinstance(value, dict) else [value]
    for v in values:
        if v not in STREAMS:
            raise ValueError(f"{v}: streams are 0 (neither), 1 (stdout), 2 (stderr) or 3 (both)")
    if isinstance(value, dict) and any(rank < 0 for rank in value):
        raise ValueError("local ranks are 0 or more")
    return value


class LogsSection(Section):
    """Where each worker's output goes: its log (``logs/rank-N.log``), capped, and the
    ``planaria run`` console.

    The log is capped: past ``max_bytes`` it is rotated to ``rank-N.log.1`` ...
    ``rank-N.log.<keep>``, the oldest dropped, so a worker's output takes at most ``max_bytes
    * (keep + 1)`` on disk. Every line also shows on the console, prefixed ``[rankN]:``, as
    torchrun shows it, unless ``console`` is off, ``redirects`` keeps a stream off it (``tee``
    puts it back, as torchrun's does) or ``local_ranks_filter`` leaves the rank out. A log
    always holds both streams."""

    max_bytes: ByteSize = Field(
        default=ByteSize(100 << 20),
        ge=4096,
        description="the most one worker log file holds before it is rotated (e.g. 100MiB)",
    )
    keep: int = Field(default=3, ge=0, le=1000, description="rotated files kept per worker")
    dir: Path | None = Field(
        default=None,
        description="where the worker logs go, in a folder per run (torchrun's --log-dir); "
        "default: the run's logs/ folder",
    )
    console: bool = Field(
        default=True, description="show the workers' output on the planaria run console"
    )
    redirects: StreamsValue = Field(
        default=0,
        description="streams kept off the console, only in the log: 0-3 (1 stdout, 2 stderr, "
        "3 both) or per local rank, e.g. '0:1,1:2' (torchrun's --redirects)",
    )
    tee: StreamsValue = Field(
        default=0,
        description="streams shown on the console although redirected, as redirects takes "
        "them (torchrun's --tee)",
    )
    local_ranks_filter: list[int] | None = Field(
        default=None,
        description="only these local ranks on the console, e.g. '0,1' (torchrun's "
        "--local-ranks-filter); default: all",
    )

    @field_validator("redirects", "tee", mode="before")
    @classmethod
    def _streams(cls, value: Any) -> Any:
        return parse_streams(value)

    @field_validator("redirects", "tee")
    @classmethod
    def _streams_range(cls, value: StreamsValue) -> StreamsValue:
        return _check_streams(value)

    @field_validator("local_ranks_filter", mode="before")
    @classmethod
    def _ranks(cls, value: Any) -> Any:
        return parse_ranks(value)

    @field_validator("local_ranks_filter")
    @classmethod
    def _ranks_range(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(rank < 0 for rank in value):
            raise ValueError("local ranks are 0 or more")
        return value


class JobSection(Section):
    name: str = Field(default="planaria-job", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    command: list[str] = Field(
        default_factory=list,
        description="the training command, as a list or a string split like a shell would "
        "(never run through a shell)",
    )
    nodes: NodeRange = Field(default_factory=lambda: NodeRange(min=1, max=1))
    procs_per_node: int = Field(default=1, ge=1, le=MAX_PROCS_PER_NODE)
    max_restarts: int = Field(default=3, ge=0)
    standby: int = Field(
        default=0,
        ge=0,
        description="extra nodes started with the job and kept warm (agent registered, torch "
        "imported), in no round: a lost node's place is taken by one of them at once, and the "
        "scheduler refills the pool in the background",
    )
    node_unit: int = Field(default=1, ge=1)
    workdir: Path = Path(".")
    env: dict[str, str] = Field(default_factory=dict)
    run_dir: Path = Field(
        default=Path("planaria-runs"),
        description="where each run gets a folder: event timeline, logs, checkpoints",
    )
    preload: list[str] = Field(
        default_factory=lambda: ["torch", "torch._dynamo"],
        description="modules a warm interpreter imports once, so that restarted workers skip "
        "the import; torch's optimizers import torch._dynamo on construction (~1.7 s)",
    )
    stop_grace: Duration = Field(
        default=5.0, description="SIGTERM, then SIGKILL after this long, when stopping workers"
    )
    logs: LogsSection = Field(default_factory=LogsSection)

    @field_validator("command", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return shlex.split(value)
            except ValueError as exc:
                raise ValueError(f"cannot split command {value!r}: {exc}") from None
        return value

    @field_validator("command")
    @classmethod
    def _passable_args(cls, value: list[str]) -> list[str]:
        for index, arg in enumerate(value):
            if "\0" in arg:
                raise ValueError(
                    f"argument {index} ({arg!r}) holds a NUL byte, which no program can be given"
                )
            if len(os.fsencode(arg)) >= MAX_ARG_STRLEN:
                raise ValueError(
                    f"argument {index} is {len(os.fsencode(arg))} bytes long; Linux starts no "
                    f"program with an argument of {MAX_ARG_STRLEN} bytes or more: pass large "
                    "data in a file"
                )
        return value

    @field_validator("env")
    @classmethod
    def _passable_env(cls, value: dict[str, str]) -> dict[str, str]:
        for name, text in value.items():
            if not name or "=" in name or "\0" in name:
                raise ValueError(
                    f"invalid variable name {name!r}: a name must be non-empty, without '=' "
                    "or NUL bytes"
                )
            if "\0" in text:
                raise ValueError(
                    f"the value of {name} holds a NUL byte, which no environment can carry"
                )
            size = len(os.fsencode(name)) + 1 + len(os.fsencode(text))
            if size >= MAX_ARG_STRLEN:
                raise ValueError(
                    f"{name}={text[:20]!r}... is {size} bytes long; Linux starts no program "
                    f"with a variable of {MAX_ARG_STRLEN} bytes or more: pass large data in a "
                    "file"
                )
        return value

    @field_validator("workdir", "run_dir")
    @classmethod
    def _passable_path(cls, value: Path) -> Path:
        if "\0" in str(value):
            raise ValueError(f"{str(value)!r} holds a NUL byte, which no path can")
        return value

    @model_validator(mode="after")
    def _fits_exec(self) -> JobSection:
        # What execve() takes: every string with its NUL and its pointer. The workers get the
        # agent's own environment on top, so this is a floor; past it nothing can start.
        size = sum(len(os.fsencode(arg)) + 1 + 8 for arg in self.command) + sum(
            len(os.fsencode(k)) + len(os.fsencode(v)) + 2 + 8 for k, v in self.env.items()
        )
        limit = _arg_max()
        if limit is not None and size > limit:
            raise ValueError(
                f"the command and env take {size} bytes, more than this machine passes to a "
                f"program (ARG_MAX: {limit} bytes, shared with the inherited environment): "
                "pass large data in a file"
            )
        return self

    @model_validator(mode="after")
    def _standby_fits(self) -> JobSection:
        if self.nodes.max + self.standby > MAX_NODES:
            raise ValueError(
                f"{self.nodes.max} nodes and {self.standby} standing by are more than "
                f"{MAX_NODES}: more than any cluster has"
            )
        return self

    @model_validator(mode="after")
    def _unit_fits(self) -> JobSection:
        if self.node_unit > self.nodes.max:
            raise ValueError(
                f"node_unit ({self.node_unit}) is larger than the most nodes the job can have "
                f"({self.nodes.max})"
            )
        return self
