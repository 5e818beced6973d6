"""Wire models of diagnosis (JSON under ``/v1``, like :mod:`planaria.protocol`): what agents
need to watch their node, and what they report when they find something."""

from __future__ import annotations

from typing import Any

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
