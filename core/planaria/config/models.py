"""The configuration file's schema: one pydantic model per section.

Every model forbids unknown keys, so a typo is an error rather than a silently ignored setting.
Backend sections (``{backend: NAME, options: {...}}``) keep ``options`` as a plain mapping here;
the selected plugin's own ``Options`` model validates it once the name is resolved
(:mod:`planaria.config.resolve`).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args, get_origin

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from planaria.chaos import ChaosRule
from planaria.durations import Duration
from planaria.errors import PluginError
from planaria.fault_pattern.api import FaultPattern
from planaria.plugin.records import PluginKind

MAX_NODES = 100_000
"""More nodes than any cluster has: the master is built for 10,000."""
MAX_PROCS_PER_NODE = 1024
"""More workers than any node has accelerators or cores; a scheduler bounds it further by
what its nodes have."""
MAX_ARG_STRLEN = 131072
"""Linux refuses to start a program given one argument or environment string longer than
this (32 pages), whatever ARG_MAX says."""


class Section(BaseModel):
    # Defaults are not re-validated: a default backend is resolved only if installed
    # (planaria.config.resolve), so that a file may leave out what its command never uses.
    model_config = ConfigDict(extra="forbid")


class BackendSection(Section):
    """``{backend: NAME, options: {...}}``: a plugin chosen by name, and its options.

    Validated with a plugin manager in the validation context (``context={"plugins": pm}``),
    ``backend`` must name an installed plugin of the section's kind and ``options`` becomes an
    instance of that plugin's ``Options`` model, so that every problem of the file, plugin
    options included, is reported in one pass. Without a manager ``options`` stays a mapping.
    """

    kind: ClassVar[PluginKind]

    backend: str = Field(min_length=1)
    options: Any = Field(default_factory=dict, description="the selected plugin's options")

    @field_validator("backend")
    @classmethod
    def _installed(cls, value: str, info: ValidationInfo) -> str:
        manager = (info.context or {}).get("plugins")
        if manager is not None:
            try:
                manager.resolve(cls.kind, value)
            except PluginError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("options")
    @classmethod
    def _validate_options(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, BaseModel):
            return value
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ValueError(f"expected a mapping of options, got {type(value).__name__}")
        manager = (info.context or {}).get("plugins")
        if manager is None or "backend" not in info.data:
            return value  # no manager, or the backend is already reported as unknown
        return manager.resolve(cls.kind, info.data["backend"]).options.model_validate(value)

    @property
    def resolved(self) -> bool:
        return isinstance(self.options, BaseModel)


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
    def _unit_fits(self) -> JobSection:
        if self.node_unit > self.nodes.max:
            raise ValueError(
                f"node_unit ({self.node_unit}) is larger than the most nodes the job can have "
                f"({self.nodes.max})"
            )
        return self


class SchedulerSection(BackendSection):
    kind: ClassVar[PluginKind] = PluginKind.SCHEDULER
    backend: str = Field(default="local", min_length=1)


class RendezvousSection(Section):
    """How the master forms rounds. Rendezvous is the master's own work, not a plugin: its
    exclusions, rank keeping and restore decisions need every join to pass through it."""

    join_timeout: Duration = Field(default=300.0, description="how long a round may wait")
    join_grace: Duration = Field(
        default=10.0, description="once min nodes joined, close when nobody came for this long"
    )

    @model_validator(mode="before")
    @classmethod
    def _no_backend(cls, value: Any) -> Any:
        if isinstance(value, dict) and "backend" in value:
            if value["backend"] != "master":
                raise ValueError(
                    f"backend {value['backend']!r}: rounds are formed by the job master, the "
                    "one backend there is; remove rendezvous.backend"
                )
            value = {k: v for k, v in value.items() if k != "backend"}
        return value


class CheckSection(BackendSection):
    """One configured health check; ``- host`` is short for ``- {backend: host}``."""

    kind: ClassVar[PluginKind] = PluginKind.HEALTH_CHECK

    name: str | None = Field(default=None, description="label; defaults to the backend name")
    timeout: Duration = Field(default=60.0)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"backend": value} if isinstance(value, str) else value

    @property
    def label(self) -> str:
        return self.name or self.backend


class BenchmarkSection(BackendSection):
    """The pre-flight node benchmark; ``cpu`` is short for ``{backend: cpu}``."""

    kind: ClassVar[PluginKind] = PluginKind.NODE_BENCHMARK
    backend: str = Field(default="cpu", min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"backend": value} if isinstance(value, str) else value


class DiagnosisSection(Section):
    checks: list[CheckSection] = Field(default_factory=lambda: [CheckSection(backend="host")])
    preflight: bool = Field(
        default=False,
        description="before training, benchmark every node in small groups; replace faulty "
        "nodes, report slow ones",
    )
    preflight_benchmark: BenchmarkSection = Field(
        default_factory=BenchmarkSection,
        description="the node benchmark of the pre-flight check (a plugin; built in: cpu)",
    )
    preflight_factor: float | None = Field(
        default=None,
        gt=1.0,
        description="a node is slow when a measure exceeds this times the other nodes' median; "
        "default: straggler_factor",
    )
    preflight_timeout: Duration = Field(
        default=60.0, description="one benchmark run: start-up, forming the group, the benchmark"
    )
    preflight_replace_stragglers: bool | None = Field(
        default=None,
        description="replace the nodes the pre-flight finds slow; default: replace_stragglers",
    )
    hang_timeout: Duration = 300.0
    straggler_factor: float = Field(
        default=2.0,
        gt=1.0,
        description="a rank is a straggler when its median step time exceeds this times the "
        "other ranks' median",
    )
    first_step_timeout: Duration | None = Field(
        default=None,
        description="a hang before the first step of an attempt (start-up, checkpoint "
        "loading); unset: only hang_timeout, which starts at the first step",
    )
    straggler_window: int = Field(
        default=20, ge=3, description="steps over which each rank's step time is a median"
    )
    replace_stragglers: bool = Field(
        default=False, description="replace the node of a straggler (and avoid its host)"
    )
    fault_patterns: list[FaultPattern] = Field(
        default_factory=list,
        description="log patterns that classify a worker fault, before the built-in ones",
    )
    on_user_error: Literal["restart", "stop"] = Field(
        default="restart",
        description="a Python exception with no hardware pattern: restart in place, or stop",
    )
    crash_loop_rounds: int = Field(
        default=2,
        ge=0,
        description="stop when a rank fails with the same error before any step in this many "
        "consecutive rounds (a crash loop; a kill from outside is no error); 0: restart until "
        "max_restarts is spent",
    )

    @model_validator(mode="after")
    def _distinct_names(self) -> DiagnosisSection:
        first: dict[str, int] = {}
        for index, check in enumerate(self.checks):
            if check.label in first:
                raise ValueError(
                    f"checks[{first[check.label]}] and checks[{index}] are both named "
                    f"{check.label!r}; give each a distinct name"
                )
            first[check.label] = index
        return self


class StorageSection(BackendSection):
    kind: ClassVar[PluginKind] = PluginKind.CHECKPOINT_STORAGE
    backend: str = Field(default="local", min_length=1)


class CheckpointSection(Section):
    storage: StorageSection = Field(default_factory=StorageSection)
    keep_last: int = Field(default=3, ge=1)
    persist_every: int = Field(default=100, ge=1, description="persist every N steps")
    persist_on_fault: bool = True
    require_restore: bool = Field(
        default=False,
        description="stop the job, rather than start from scratch, when committed steps "
        "exist but none verifies",
    )
    allow_unpersisted_end: bool = Field(
        default=False,
        description="let a job whose last persist failed end as succeeded (exit 0); by "
        "default it ends failed, naming its last persisted step",
    )
    persister_timeout: float = Field(
        default=5.0,
        gt=0,
        description="the most seconds a save waits for the node's persister; one that does "
        "not answer within it is replaced",
    )


class PluginsSection(Section):
    disable: list[str] = Field(
        default_factory=list, description="plugins not to load, by plugin or distribution name"
    )


class LoggingSection(Section):
    format: Literal["console", "json"] = "console"
    level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value


class MasterSection(Section):
    host: str = Field(default="127.0.0.1", description="address the master's API binds")
    port: int = Field(default=0, ge=0, le=65535, description="0: any free port")
    advertise: str | None = Field(
        default=None,
        description="address or name agents use to reach the master (default: host; for a "
        "host that binds every interface, 0.0.0.0 or ::, the master chooses one: "
        "$PLANARIA_MASTER_ADVERTISE, else the address it reaches the nodes' machines from, "
        "else its default route's, else its name, and says which)",
    )

    @field_validator("advertise")
    @classmethod
    def _reachable(cls, value: str | None) -> str | None:
        """What agents are told goes into a URL and the job's certificate as it is: an IP
        address or a DNS name, never a wildcard, a URL or host:port (the port is master.port)."""
        from planaria.master.advertise import carried_name, is_wildcard

        if value is None:
            return None
        value = value.strip()
        if not value or is_wildcard(value):
            raise ValueError(
                f"{value!r} is no address an agent can connect to: name this machine's address "
                "or name that the nodes reach, or leave it out to let the master choose"
            )
        if not carried_name(value):
            raise ValueError(
                f"{value!r} is neither an IP address nor a host name (no scheme, port or path: "
                "the port is master.port)"
            )
        return value

    tls: bool | None = Field(
        default=None,
        description=(
            "serve the API over TLS with the job's own certificate, which agents pin "
            "(default: when host is not loopback); false: plain HTTP even off loopback"
        ),
    )
    heartbeat_interval: Duration = 2.0
    heartbeat_timeout: Duration = 15.0
    grace: Duration = Field(
        default=60.0,
        description="how long agents that lost the master keep their workers training, "
        "waiting for it (or a master resumed with `planaria run --resume`), before they stop "
        "them; a master that hears from no node waits as long before it calls them lost",
    )
    request_timeout: Duration = Field(
        default=10.0,
        gt=0,
        description="a request's headers, and then its body, must arrive within this time",
    )
    max_connections_per_client: int = Field(
        default=1024,
        ge=1,
        description="open connections one client address may hold; more are refused",
    )
    max_request_bytes: int = Field(
        default=1 << 20,
        ge=1024,
        description="largest request body the master's API reads; a larger one gets a 413",
    )
    metrics_public: bool = Field(
        default=False,
        description="serve GET /metrics (Prometheus) without the job's token, for a scraper "
        "that does not have it",
    )


class Config(Section):
    """The whole file. Every section is optional; defaults make a one-node job."""

    job: JobSection = Field(default_factory=JobSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    rendezvous: RendezvousSection = Field(default_factory=RendezvousSection)
    diagnosis: DiagnosisSection = Field(default_factory=DiagnosisSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    plugins: PluginsSection = Field(default_factory=PluginsSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    master: MasterSection = Field(default_factory=MasterSection)
    chaos: list[ChaosRule] = Field(
        default_factory=list, description="faults to inject, to rehearse recovery"
    )


def backend_sections(
    model: type[BaseModel] = Config, at: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], type[BackendSection]]]:
    """Every section of the file that selects a plugin, by where it sits: the one map from a
    config path (``("checkpoint", "storage")``; a list's items share its path) to the
    section's model, and through ``kind``, to its plugin kind."""
    for name, field in model.model_fields.items():
        annotation = field.annotation
        item = get_args(annotation)[0] if get_origin(annotation) is list else annotation
        if isinstance(item, type) and issubclass(item, BackendSection):
            yield (*at, name), item
        elif isinstance(item, type) and issubclass(item, Section):
            yield from backend_sections(item, (*at, name))
