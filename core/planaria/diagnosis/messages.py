"""Wire models of diagnosis (JSON under ``/v1``, like :mod:`planaria.protocol`): what agents
need to watch their node, and what they report when they find something."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CheckSpec(_Message):
    """One configured health check as agents run it: options as validated on the master."""

    name: str
    backend: str
    options: dict[str, Any] = Field(default_factory=dict)
    timeout: float


class DiagnosisSpec(_Message):
    """The agent's share of ``diagnosis``; part of :class:`planaria.protocol.JobSpec`."""

    hang_timeout: float = 300.0
    first_step_timeout: float | None = None
    straggler_window: int = 20
    checks: list[CheckSpec] = Field(default_factory=list)
    disable_plugins: list[str] = Field(default_factory=list)
    """``plugins.disable``: the agent loads plugins (health checks) the way the master did."""
    preflight: bool = False
    """Take part in the pre-flight node check before the first round."""


class HungRank(_Message):
    rank: int
    local_rank: int
    pid: int
    step: int
    """The last step it completed (-1: none in this attempt)."""
    stalled_s: float
    state: str
    """The kernel's process state: ``S (sleeping)``, ``T (stopped)``, ``R (running)`` ..."""
    stack: str
    """Its Python stacks (py-spy), truncated; or why they could not be taken."""


class HangReport(_Message):
    node_id: str
    round: int
    timeout: float
    first_step: bool = False
    """True: no step at all within ``first_step_timeout``; False: no progress after one."""
    ranks: list[HungRank]
    time: float


class CheckFailure(_Message):
    check: str
    status: str
    detail: str


class HealthReport(_Message):
    """A node whose health checks failed before a round: it does not join, it asks to go."""

    node_id: str
    host: str
    failures: list[CheckFailure]
    time: float


# -- the pre-flight node check -------------------------------------------------------------


class BenchmarkSpec(_Message):
    """The configured node benchmark as agents run it: options as validated on the master."""

    backend: str
    options: dict[str, Any] = Field(default_factory=dict)
    timeout: float
    disable_plugins: list[str] = Field(default_factory=list)


class PreflightPoll(_Message):
    """An agent asking what to do before it joins training (a long poll)."""

    node_id: str
    addr: str
    port: int = Field(ge=1, le=65535)
    """A port free on this host now, for the group's ``MASTER_PORT`` if it leads one."""
    running: str | None = None
    """The group whose benchmark this node is running: answer ``abort`` when it failed."""


class PreflightTask(_Message):
    """Run the benchmark once, as ``rank`` of the group ``members`` led at the address."""

    group: str
    stage: Literal["round 1", "round 2", "newcomer"]
    members: list[str]
    rank: int
    master_addr: str
    master_port: int
    benchmark: BenchmarkSpec


class PreflightOrder(_Message):
    state: Literal["run", "wait", "done", "exit", "abort"]
    task: PreflightTask | None = None
    reason: str = ""


class PreflightResult(_Message):
    node_id: str
    group: str
    status: Literal["ok", "failed", "timeout"]
    error: str = ""
    measures: dict[str, float] = Field(default_factory=dict)
    info: dict[str, float | int | str] = Field(default_factory=dict)
    seconds: float = 0.0
    """Wall time of the whole run: the child's start-up, the group's forming, the benchmark."""


class BenchmarkRun(_Message):
    """What the agent hands its benchmark child process (on stdin)."""

    node_id: str
    host: str
    task: PreflightTask
    slow_factor: float = 1.0
    fail: Literal["raise", "hang"] | None = None
