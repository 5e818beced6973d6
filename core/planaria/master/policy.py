"""The master's decisions: what a fault calls for, as a pure function of the job's situation.

No I/O and no clock: the master describes its situation (:class:`Situation`), hands over what
happened (a :class:`NodeFault` or a :class:`ReplacementFailed`), and carries out the
:class:`Decision`. Every branch is a row of ``tests/test_policy.py``. In order:

- a job already stopping, or a node already out of it: nothing more to do;
- workers that cannot start: stop (a restart would fail the same way);
- a fault of the node (bad hardware, a failed health check, a straggler when stragglers are
  replaced, a failed pre-flight check, a lost agent) takes it out and asks for another in its
  place, on another host unless the node was merely lost; where no other may be asked, the job
  goes on with fewer nodes if at least ``min`` remain, else it stops;
- a failure of a round restarted already, or of no running round, that is not the node's:
  nothing more (the restart that came first covers it);
- a user error with ``diagnosis.on_user_error: stop``: stop;
- anything else (a transient fault, a user error to restart, a hang) restarts the workers;
- restarting the running world spends one of ``max_restarts``; with none left the job stops,
  and no node is asked for;
- a replacement that failed: the job goes on with the nodes it has when there are at least
  ``min`` of them (an elastic job shrinks), else it stops.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Literal

from planaria.events import StopCause


class FaultType(str, Enum):
    NODE = "node"
    """The node is at fault (diagnosed hardware, a failed check, too slow)."""
    TRANSIENT = "transient"
    USER = "user"
    """The program's own error."""
    HANG = "hang"
    LOST = "lost"
    """The node's agent ended or went silent: the node is gone, nothing says its host is bad."""


class Source(str, Enum):
    """Who found the fault."""

    WORKERS = "workers"
    """The running round's workers failed."""
    LATE = "late"
    """Workers whose round was restarted already failed (a peer's report came first)."""
    START = "start"
    """The workers could not start at all."""
    WATCHDOG = "watchdog"
    """No step progress (or no first step) in time."""
    HEALTH_CHECK = "health_check"
    STRAGGLER = "straggler"
    PREFLIGHT = "preflight"
    """The pre-flight node check found the node faulty."""
    PREFLIGHT_STRAGGLER = "preflight_straggler"
    AGENT = "agent"
    """The node's agent process ended, or sent no heartbeat in time."""


PREFLIGHT_SOURCES = (Source.PREFLIGHT, Source.PREFLIGHT_STRAGGLER)


class Act(str, Enum):
    NONE = "none"
    RESTART = "restart"
    """Restart the workers in place."""
    REPLACE = "replace"
    """Take the node out and ask the scheduler for another."""
    SHRINK = "shrink"
    """Take the node out (if it is not out yet) and go on with fewer nodes."""
    STOP = "stop"


CANNOT_START = "stop: the workers cannot start, and a restart would fail the same way"


@dataclass(frozen=True)
class Rules:
    """The job's settings that decide (from its config)."""

    max_restarts: int
    min_nodes: int
    max_nodes: int
    on_user_error: Literal["restart", "stop"] = "restart"
    replace_stragglers: bool = False
    preflight_replace_stragglers: bool = False
    preflight_only: bool = False
    """``planaria check --preflight``: report faulty nodes, replace none."""


@dataclass(frozen=True)
class Situation:
    """The job when the fault came."""

    restarts: int = 0
    """Restarts spent so far."""
    training: bool = False
    """A round is running (its members' faults restart it)."""
    stopping: bool = False
    nodes_left: int = 0
    """Nodes in the job or on their way, the one at fault not counted."""
    preflight_replaced: int = 0
    """Nodes the pre-flight check asked replacements for."""


@dataclass(frozen=True)
class NodeFault:
    type: FaultType
    source: Source
    node: str
    host: str
    detail: str
    """What happened, as the stop reason quotes it."""
    reason: str = ""
    """What the diagnosis matched."""
    in_world: bool = False
    """The node is a member of the running round."""
    node_gone: bool = False


@dataclass(frozen=True)
class ReplacementFailed:
    node: str
    error: str


Event = NodeFault | ReplacementFailed


@dataclass(frozen=True)
class Decision:
    act: Act
    action: str
    """What was done, as the summary's fault table says it."""
    remove: bool = False
    """The node leaves the job."""
    exclude_host: bool = False
    """No node of the job may run on the node's host again."""
    restart: bool = False
    """The running world restarts: one of ``max_restarts`` is spent."""
    record: bool = True
    """The fault is one of the job's faults (the summary's table); else only an event."""
    reason: str = ""
    """Why the job stops (``act`` is STOP)."""
    cause: StopCause | None = None


def decide(rules: Rules, now: Situation, event: Event) -> Decision:
    if isinstance(event, ReplacementFailed):
        return _replacement_failed(rules, now, event)
    return _fault(rules, now, event)


def _fault(rules: Rules, now: Situation, fault: NodeFault) -> Decision:
    if now.stopping:
        return Decision(Act.NONE, "none (the job is stopping)", record=False)
    if fault.node_gone:
        return Decision(Act.NONE, "none (the node is out of the job already)", record=False)
    if fault.source is Source.START:
        return Decision(
            Act.STOP,
            CANNOT_START,
            reason=f"user error: {fault.detail}",
            cause=StopCause.CANNOT_START,
        )
    if fault.type in (FaultType.NODE, FaultType.LOST):
        return _take_out(rules, now, fault)
    if fault.source is Source.LATE or not (fault.in_world and now.training):
        # Its round was restarted already (or none runs): only a bad node still matters.
        return Decision(Act.NONE, "none (its round was restarted already)", record=False)
    if fault.type is FaultType.USER and rules.on_user_error == "stop":
        return Decision(
            Act.STOP,
            "stop (diagnosis.on_user_error: stop)",
            reason=f"user error: {fault.detail}: {fault.reason}",
            cause=StopCause.USER_ERROR,
        )
    return _spend(rules, now, fault, Decision(Act.RESTART, "restart workers in place"))


def _take_out(rules: Rules, now: Situation, fault: NodeFault) -> Decision:
    if fault.source is Source.STRAGGLER and not rules.replace_stragglers:
        return Decision(Act.NONE, "none (diagnosis.replace_stragglers: false)", record=False)
    if fault.source is Source.PREFLIGHT_STRAGGLER and (
        rules.preflight_only or not rules.preflight_replace_stragglers
    ):
        return Decision(Act.NONE, "none (report only)", record=False)
    if fault.source in PREFLIGHT_SOURCES and rules.preflight_only:
        return Decision(Act.NONE, "none (planaria check --preflight reports only)")
    exclude = fault.type is FaultType.NODE
    restart = fault.in_world and now.training
    if fault.source in PREFLIGHT_SOURCES and now.preflight_replaced >= rules.max_nodes:
        # A run of bad nodes must not have the check ask for new ones forever.
        why = f"the pre-flight replaced {now.preflight_replaced} node(s) already"
        if now.nodes_left < rules.min_nodes:
            return _too_few(rules, now, f"stop: {why}", why)
        shrink = Decision(
            Act.SHRINK, f"stop the node, no replacement: {why}", remove=True, restart=restart
        )
        return _spend(rules, now, fault, shrink) if restart else shrink
    action = f"replace the node, exclude host {fault.host}" if exclude else "replace the node"
    decision = Decision(Act.REPLACE, action, remove=True, exclude_host=exclude, restart=restart)
    return _spend(rules, now, fault, decision) if restart else decision


def _spend(rules: Rules, now: Situation, fault: NodeFault, decision: Decision) -> Decision:
    """``decision`` restarts the running world, if a restart is left."""
    if now.restarts < rules.max_restarts:
        return replace(decision, restart=True)
    return Decision(
        Act.STOP,
        "stop: restart budget spent",
        remove=decision.remove,
        reason=(
            f"restart budget spent ({now.restarts} of {rules.max_restarts} restarts used); "
            f"last fault: {fault.detail}"
        ),
        cause=StopCause.RESTART_BUDGET_SPENT,
    )


def _too_few(rules: Rules, now: Situation, action: str, why: str) -> Decision:
    return Decision(
        Act.STOP,
        action,
        remove=True,
        reason=(
            f"{why}, and {now.nodes_left} node(s) are left: the job needs at least "
            f"{rules.min_nodes} (job.nodes)"
        ),
        cause=StopCause.TOO_FEW_NODES,
    )


def _replacement_failed(rules: Rules, now: Situation, failed: ReplacementFailed) -> Decision:
    if now.stopping:
        return Decision(Act.NONE, "none (the job is stopping)", record=False)
    why = f"node {failed.node} could not be replaced ({failed.error})"
    if now.nodes_left < rules.min_nodes:  # the node is out already
        stop = _too_few(rules, now, "stop: too few nodes", why)
        return replace(stop, remove=False, record=False)
    return Decision(Act.SHRINK, f"go on with {now.nodes_left} node(s)", record=False)
