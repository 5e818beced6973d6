"""The configuration file's schema: one pydantic model per section.

Every model forbids unknown keys, so a typo is an error rather than a silently ignored setting.
Backend sections (``{backend: NAME, options: {...}}``) keep ``options`` as a plain mapping here;
the selected plugin's own ``Options`` model validates it once the name is resolved
(:mod:`planaria.config.resolve`).

The sections' base models are :mod:`planaria.config.section`'s, the ``job`` section is
:mod:`planaria.config.job`'s; the others, and the whole file (:class:`Config`), are here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar, Literal, get_args, get_origin

from pydantic import (
    BaseModel,
    Field,
    field_validator,
    model_validator,
)

from planaria.chaos import ChaosRule
from planaria.config.job import (
    MAX_ARG_STRLEN,
    MAX_NODES,
    MAX_PROCS_PER_NODE,
    STREAMS,
    JobSection,
    LogsSection,
    NodeRange,
    parse_ranks,
    parse_streams,
)
from planaria.config.section import BackendSection, Section
from planaria.durations import Duration
from planaria.fault_pattern.api import FaultPattern
from planaria.plugin.records import PluginKind

__all__ = [
    "MAX_ARG_STRLEN",
    "MAX_NODES",
    "MAX_PROCS_PER_NODE",
    "STREAMS",
    "BackendSection",
    "BenchmarkSection",
    "CheckSection",
    "CheckpointSection",
    "Config",
    "DiagnosisSection",
    "JobSection",
    "LoggingSection",
    "LogsSection",
    "MasterSection",
    "NodeRange",
    "PluginsSection",
    "RendezvousSection",
    "SchedulerSection",
    "Section",
    "StorageSection",
    "backend_sections",
    "parse_ranks",
    "parse_streams",
]


class SchedulerSection(BackendSection):
    kind: ClassVar[PluginKind] = PluginKind.SCHEDULER
    backend: str = Field(default="local", min_length=1)


class RendezvousSection(BackendSection):
    """How the master forms rounds. Membership, exclusion and fencing are the master's own
    work (every join passes through it); ``backend`` picks the rank placement, which member
    gets which node rank (:mod:`planaria.rendezvous.api`)."""

    kind: ClassVar[PluginKind] = PluginKind.RENDEZVOUS
    backend: str = Field(default="stable", min_length=1)
    join_timeout: Duration = Field(default=300.0, description="how long a round may wait")
    join_grace: Duration = Field(
        default=10.0, description="once min nodes joined, close when nobody came for this long"
    )
    store: Literal["rank0", "master"] = Field(
        default="rank0",
        description="who hosts the workers' torch.distributed store: the worker of rank 0 "
        "(rank0), or a process beside the master, a fresh store each round (master)",
    )

    @model_validator(mode="before")
    @classmethod
    def _master_is_stable(cls, value: Any) -> Any:
        # Files from before rank placements were plugins named the one backend "master",
        # which placed ranks as ``stable`` does.
        if isinstance(value, dict) and value.get("backend") == "master":
            value = {**value, "backend": "stable"}
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


class ReplicaSection(Section):
    every: int = Field(
        default=1,
        ge=1,
        description="copy a saved step whose number is a multiple of this to the buddy node "
        "(the newest such when the last copy is done)",
    )
    max_mb_per_second: float | None = Field(
        default=None,
        gt=0,
        description="the most a node sends its buddy, in megabytes (10^6 bytes) per second; "
        "unset: no bound",
    )


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
    replica: ReplicaSection | None = Field(
        default=None,
        description="peer replicas: each node copies its newest saved step into the shared "
        "memory of the next node of the ring, so that a node's replacement restores from "
        "memory, not storage ({} for the defaults; unset: none)",
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
