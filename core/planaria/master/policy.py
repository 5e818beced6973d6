"""The master's decisions: what a fault calls for, as a pure function of the job's situation.

No I/O and no clock: the master describes its situation (:class:`Situation`), hands over what
happened (a :class:`NodeFault` or a :class:`ReplacementFailed`), and carries out the
:class:`Decision`. Every branch is a row of ``tests/unit/test_policy.py``. In order:

- a job already stopping, or a node already out of it: nothing more to do;
- workers that cannot start: stop (a restart would fail the same way);
- a fault of the node (bad hardware, a failed health check, a straggler when stragglers are
  replaced, a failed pre-flight check, a lost agent) takes it out and asks for another in its
  place, on another host unless the node was merely lost; where no other may be asked, the job
  goes on with fewer nodes if at least ``min`` remain, else it stops;
- a failure of a round restarted already, or of no running round, that is not the node's:
  nothing more (the restart that came first covers it);
- a user error with ``diagnosis.on_user_error: stop``: stop;
- a crash loop: a rank that failed with the same error of its own (the same exception line,
  exit code or fatal signal it raised) before any step in ``diagnosis.crash_loop_rounds``
  consecutive rounds: stop (the next restart would fail alike). A kill by a signal another
  process sends (:data:`OUTSIDE_SIGNALS`) is no error of the program's and never counts;
  when the job has reported no step yet, the reason does not claim the failures came before
  one;
- anything else (a transient fault, a user error to restart, a hang) restarts the workers;
- restarting the running world spends one of ``max_restarts``; with none left the job stops,
  and no node is asked for;
- a replacement that failed: the job goes on with the nodes it has when there are at least
  ``min`` of them (an elastic job shrinks), else it stops.
"""

from __future__ import annotations

from collections.abc import Iterable
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

OUTSIDE_SIGNALS = frozenset(
    {"SIGKILL", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"}
)
"""Signals one process sends another (an operator, the OOM killer, a scheduler, the agent):
a worker they end did not fail by itself, and another one would not fail alike. The fatal
signals a program raises on itself (SIGSEGV, SIGABRT, SIGBUS, ...) are its own error."""


@dataclass(frozen=True)
class Crash:
    """A worker that failed before its round completed any step: what a crash loop is made of."""

    rank: int
    error: str
    """Its last words: the last exception line of its traceback, else how it ended (``exit
    code 1``, ``killed by SIGKILL``)."""
    round: int
    rounds: int = 1
    """Consecutive rounds, up to ``round``, in which the rank failed so."""
    signal: str | None = None
    """The signal that ended it (``SIGKILL``), if one did."""

    @property
    def killed(self) -> bool:
        """Ended by a signal from outside (:data:`OUTSIDE_SIGNALS`): no error of its own, so
        no crash loop's, and it breaks the rank's run of repeats."""
        return self.signal in OUTSIDE_SIGNALS

    def repeats(self, before: Crash) -> bool:
        """This crash is ``before``'s error again, in the round after it."""
        return (
            not (self.killed or before.killed)
            and before.round == self.round - 1
            and before.error == self.error
        )


def remember(memory: Iterable[Crash], crashes: Iterable[Crash]) -> tuple[Crash, ...]:
    """``memory`` (each rank's last crash) with ``crashes`` added: a rank whose crash repeats
    the one it had in the round before counts one round more. A rank's crash of a round already
    remembered is not counted twice; crashes older than the round before the newest cannot go
    on, and are forgotten."""
    last = {c.rank: c for c in memory}
    for crash in crashes:
        before = last.get(crash.rank)
        if before is None:
            last[crash.rank] = replace(crash, rounds=1)
        elif before.round < crash.round:
            repeats = crash.repeats(before)
            last[crash.rank] = replace(crash, rounds=before.rounds + 1 if repeats else 1)
    newest = max((c.round for c in last.values()), default=0)
    return tuple(sorted((c for c in last.values() if c.round >= newest - 1), key=_rank))


def _rank(crash: Crash) -> int:
    return crash.rank


@dataclass(frozen=True)
class Rules:
    """The job's settings that decide (from its config)."""

    max_restarts: int
    min_nodes: int
    max_nodes: int
    on_user_error: Literal["restart", "stop"] = "restart"
    crash_loop_rounds: int = 2
    """Stop when a rank fails with the same error of its own before any step in this many
    consecutive rounds; 0: never."""
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
    crashes: tuple[Crash, ...] = ()
    """Each rank's last crash before any step (:func:`remember`), this fault's not yet."""
    stepped: bool = False
    """Some round of the job reported a step: a failure in a round without one is known to
    have come before any step. Without any, the job may just not report steps."""


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
    crashes: tuple[Crash, ...] = ()
    """Its failed workers, when their round had completed no step."""


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
    loop = _crash_loop(rules, now, fault)
    if loop is not None:
        return loop
    return _spend(rules, now, fault, Decision(Act.RESTART, "restart workers in place"))


def _crash_loop(rules: Rules, now: Situation, fault: NodeFault) -> Decision | None:
    """Stop when one of the fault's crashes repeats ``crash_loop_rounds`` rounds in a row."""
    if rules.crash_loop_rounds == 0 or not fault.crashes:
        return None
    ranks = {c.rank for c in fault.crashes}
    counted = [c for c in remember(now.crashes, fault.crashes) if c.rank in ranks]
    looping = [c for c in counted if c.rounds >= rules.crash_loop_rounds and not c.killed]
    if not looping:
        return None
    crash = looping[0]
    when = "before any step" if now.stepped else "before any step was reported (it reports none)"
    what = f"rank {crash.rank} failed with {crash.error!r}"
    if crash.rounds > 1:
        times = "twice" if crash.rounds == 2 else f"{crash.rounds} times"
        what += f" {times}, in {crash.rounds} consecutive rounds, each time {when}"
    else:
        what += f" {when}"
    return Decision(
        Act.STOP,
        f"stop: crash loop (diagnosis.crash_loop_rounds: {rules.crash_loop_rounds})",
        reason=(
            f"crash loop: {what}; a restart would fail the same way. Fix the error, or set "
            f"diagnosis.crash_loop_rounds (now {rules.crash_loop_rounds}; 0 turns this off) "
            "to restart anyway"
        ),
        cause=StopCause.CRASH_LOOP,
    )


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
