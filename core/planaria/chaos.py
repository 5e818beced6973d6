"""Fault injection: rehearse recovery on a real job.

Rules come from the ``chaos:`` config section or ``planaria run --chaos``. Worker-side rules
(``kill_worker``, ``raise_in_worker``, ``stop_worker``, ``hang_worker`` and ``slow_worker`` at a
step) fire inside the worker, in :func:`planaria.monitor.step`, so they hit the exact step; they
also work under torchrun when ``PLANARIA_CHAOS`` is set. Time-based rules and ``kill_node`` fire
in the agent.

Pre-flight rules (``slow_node``, ``fail_node``) act on the pre-flight node check, which runs
before node ranks exist: they name a node by the id its scheduler gave it (``node=node-3``; the
local scheduler numbers nodes in launch order from ``node-0``, replacements after them). They
apply to every pre-flight benchmark that node runs.

A rule fires in one attempt only: ``attempt`` is the restart count it waits for (0 = the first
run), so a rule never fires again after the recovery it caused.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from planaria.durations import Duration

ENV = "PLANARIA_CHAOS"

Kind = Literal[
    "kill_worker",
    "raise_in_worker",
    "kill_node",
    "stop_worker",
    "hang_worker",
    "slow_worker",
    "slow_node",
    "fail_node",
]
# Rules that can only fire inside the worker, at a step.
_STEP_ONLY = ("raise_in_worker", "stop_worker", "hang_worker", "slow_worker")
# Rules that act on the pre-flight node check, on a node named by its id.
PREFLIGHT = ("slow_node", "fail_node")


class ChaosRule(BaseModel):
    """``{kind: kill_worker, rank: 1, at_step: 20}`` or, on the command line,
    ``--chaos "kill_worker rank=1 at_step=20"``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Kind
    rank: int | None = Field(default=None, ge=0, description="global rank (worker rules)")
    node_rank: int | None = Field(default=None, ge=0, description="node rank (kill_node)")
    at_step: int | None = Field(default=None, ge=0)
    after: Duration | None = Field(default=None, description="time since the workers started")
    attempt: int = Field(default=0, ge=0, description="the restart count in which it fires")
    factor: float | None = Field(
        default=None,
        gt=1.0,
        description="slow_worker, slow_node: how many times slower the rank or node computes",
    )
    node: str | None = Field(
        default=None, min_length=1, description="node id (slow_node, fail_node), e.g. node-3"
    )
    how: Literal["raise", "hang"] | None = Field(
        default=None, description="fail_node: the benchmark raises (default) or never returns"
    )

    @model_validator(mode="before")
    @classmethod
    def _parse_text(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return _slow_from_the_start(value)
        kind, *pairs = value.split()
        data: dict[str, Any] = {"kind": kind}
        for pair in pairs:
            key, sep, item = pair.partition("=")
            if not sep:
                raise ValueError(f"expected KEY=VALUE after the kind, got {pair!r}")
            data[key] = item
        return _slow_from_the_start(data)

    @model_validator(mode="after")
    def _consistent(self) -> ChaosRule:
        if self.kind in PREFLIGHT:
            return self._consistent_preflight()
        if self.node is not None or self.how is not None:
            raise ValueError(f"{self.kind} takes no node or how (only slow_node, fail_node do)")
        if (self.at_step is None) == (self.after is None):
            raise ValueError("give exactly one of at_step or after")
        if self.kind == "kill_node":
            if self.node_rank is None or self.rank is not None:
                raise ValueError("kill_node takes node_rank (not rank)")
        else:
            if self.rank is None or self.node_rank is not None:
                raise ValueError(f"{self.kind} takes rank (the global rank, not node_rank)")
            if self.kind in _STEP_ONLY and self.at_step is None:
                raise ValueError(f"{self.kind} fires inside the worker: give at_step")
        if (self.kind == "slow_worker") != (self.factor is not None):
            raise ValueError("slow_worker takes factor (and only slow_worker does)")
        return self

    def _consistent_preflight(self) -> ChaosRule:
        if self.node is None:
            raise ValueError(f"{self.kind} takes node (the node id, e.g. node=node-3)")
        extra = [
            key
            for key in ("rank", "node_rank", "at_step", "after")
            if getattr(self, key) is not None
        ]
        if extra or self.attempt:
            keys = ", ".join(extra or ["attempt"])
            raise ValueError(
                f"{self.kind} acts on the pre-flight check, before training: it takes no {keys}"
            )
        if (self.kind == "slow_node") != (self.factor is not None):
            raise ValueError("slow_node takes factor (and fail_node does not)")
        if self.kind == "slow_node" and self.how is not None:
            raise ValueError("how is for fail_node (raise or hang)")
        return self

    @property
    def in_worker(self) -> bool:
        return self.kind not in ("kill_node", *PREFLIGHT) and self.at_step is not None

    @property
    def in_preflight(self) -> bool:
        return self.kind in PREFLIGHT


def _slow_from_the_start(data: Any) -> Any:
    """A ``slow_worker`` without ``at_step`` is slow from the first step."""
    slow = isinstance(data, dict) and data.get("kind") == "slow_worker"
    if slow and data.get("at_step") is None and data.get("after") is None:
        return {**data, "at_step": 0}
    return data


def worker_rules_env(rules: list[ChaosRule]) -> str:
    return json.dumps([r.model_dump(mode="json") for r in rules if r.in_worker])


class InjectedFault(RuntimeError):
    """Raised in a worker by a ``raise_in_worker`` rule."""


def burn(seconds: float) -> None:
    """Keep this CPU busy for ``seconds`` of this process's CPU time: a slower processor."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


class WorkerChaos:
    """The rules that concern this worker, checked on every step."""

    def __init__(self, env: dict[str, str] | os._Environ[str] = os.environ) -> None:
        self.rules: list[ChaosRule] = []
        text = env.get(ENV)
        if not text:
            return
        rank = int(env.get("RANK", "0"))
        attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        for item in json.loads(text):
            rule = ChaosRule.model_validate(item)
            if rule.in_worker and rule.rank == rank and rule.attempt == attempt:
                self.rules.append(rule)

    def check(self, step: int, busy: float | None = None) -> float:
        """Fire the rules due at ``step``. ``busy``: the CPU time the step took, without what
        this returns: the CPU time burnt here by a ``slow_worker`` rule."""
        burnt = 0.0
        for rule in self.rules:
            if rule.kind == "slow_worker":
                assert rule.at_step is not None and rule.factor is not None
                if step >= rule.at_step and busy is not None:
                    burnt += (rule.factor - 1.0) * busy
                    burn((rule.factor - 1.0) * busy)
                continue
            if rule.at_step == step:
                message = (
                    f"planaria chaos: {rule.kind} rank={rule.rank} at_step={step} "
                    f"attempt={rule.attempt} time={time.time():.6f}"
                )
                print(message, file=sys.stderr, flush=True)
                if rule.kind == "kill_worker":
                    os.kill(os.getpid(), signal.SIGKILL)
                if rule.kind == "stop_worker":  # alive, holding its peers in the next collective
                    os.kill(os.getpid(), signal.SIGSTOP)
                    continue
                if rule.kind == "hang_worker":  # as a deadlock would: never returns
                    while True:
                        time.sleep(3600)
                raise InjectedFault(message)
        return burnt
