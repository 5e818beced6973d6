"""Carrying out what the policy decides about a fault, and the job's faults with their outcome.

:func:`planaria.master.policy.decide` says what a fault calls for; :class:`Recovery` does it:
takes the node out, restarts the running world (spending the restart budget), asks the
scheduler for a node in its place or lets the job go on without it, or stops the job. It keeps
every fault with what became of it (where the restart restored from, when training ran again,
the steps lost) for the timeline and the summary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from planaria import events
from planaria.events import StopCause
from planaria.fault_pattern.api import FaultClass
from planaria.log import get_logger
from planaria.master.fleet import Fleet
from planaria.master.policy import (
    PREFLIGHT_SOURCES,
    Act,
    Crash,
    Decision,
    FaultType,
    NodeFault,
    ReplacementFailed,
    Rules,
    Situation,
    Source,
    decide,
    remember,
)
from planaria.master.rounds import Rounds
from planaria.master.state import Node, NodePhase
from planaria.master.summary import Fault
from planaria.master.timeline import Timeline
from planaria.protocol import Action

log = get_logger("master")

REFILL_WAIT = 10.0
"""Seconds a refill of the standby pool waits at most for the job to recover first."""
REFILL_POLL = 0.05


class Restartable(Protocol):
    """What recovery asks of the job itself."""

    @property
    def training(self) -> bool: ...

    @property
    def stopping(self) -> bool: ...

    @property
    def steps_known(self) -> bool:
        """The job has reported a step (its first one is known)."""
        ...

    def open_round(self) -> int:
        """Dissolve the running world (if any) and start forming the next round."""
        ...

    def stop(self, reason: str, cause: StopCause) -> None: ...

    def fence_out(self, node: Node) -> None:
        """``node`` is out: nothing it saves from now on may be committed."""
        ...

    def saw_step(self, step: int) -> None:
        """Some report told of ``step``: training got at least that far."""
        ...

    def sample_last(self, node: Node) -> None:
        """Put ``node``'s last known step in the timeline, as it leaves the running world."""
        ...


class Recovery:
    def __init__(
        self, job: Restartable, rules: Rules, fleet: Fleet, rounds: Rounds, timeline: Timeline
    ) -> None:
        self.job = job
        self.rules = rules
        self.fleet = fleet
        self.rounds = rounds
        self.timeline = timeline
        self.faults: list[Fault] = []
        self.restarts = 0
        self.preflight_replaced = 0
        """Nodes the pre-flight check had replaced: it may not ask for more than ``max``."""
        self.excluded: set[str] = set()
        """Hosts excluded by replacements that came back."""
        self.replacing: dict[str, bool] = {}
        """Nodes whose replacement was asked and has not come back: whether its host is
        excluded. A restarted master asks again for these."""
        self.crashes: tuple[Crash, ...] = ()
        """Each rank's last failure before any step (a crash loop's memory)."""
        self._stepped: set[int] = set()
        """Rounds that completed a step: their failures are no crash loop's."""

    def snapshot(self) -> dict[str, Any]:
        return {
            "restarts": self.restarts,
            "preflight_replaced": self.preflight_replaced,
            "faults": [dataclasses.asdict(f) for f in self.faults],
            "replacing": dict(self.replacing),
            "excluded": sorted(self.excluded),
        }

    def restore(self, snapshot: dict[str, Any]) -> None:
        self.restarts = int(snapshot["restarts"])
        self.preflight_replaced = int(snapshot["preflight_replaced"])
        self.faults = [Fault(**f) for f in snapshot["faults"]]
        self.replacing = {str(n): bool(x) for n, x in dict(snapshot["replacing"]).items()}
        self.excluded = {str(h) for h in snapshot["excluded"]}

    def replace(self, node: Node, exclude_host: bool) -> None:
        """Ask the scheduler for a node in ``node``'s place, in the background. When a node
        standing by takes the place and the scheduler's nodes run on this machine
        (:attr:`~planaria.scheduler.api.Scheduler.nodes_here`), the new node only refills the
        pool: it is asked for once the job has recovered (:meth:`_recovered`)."""
        self.replacing[node.node_id] = exclude_host
        refill = self.fleet.count(NodePhase.STANDBY) > 0 and self.fleet.scheduler.nodes_here
        after = self._recovered(self.rounds.round) if refill else None
        answer = self.fleet.replace(node, exclude_host=exclude_host, after=after)
        self.fleet.background(self._replaced(node, answer, exclude_host))

    async def _recovered(self, round_: int) -> None:
        """Done once round ``round_`` (the one just opened) completed a step, at most
        ``REFILL_WAIT`` seconds from now (at once when another round opens meanwhile): when a
        refill of the pool is asked for. A node starting on the machine of the others (its
        interpreter, its torch import) competes with the recovering workers for its CPUs, and
        the pool can do without it for the second a recovery takes."""
        deadline = time.monotonic() + REFILL_WAIT
        while (
            round_ not in self._stepped
            and self.rounds.round == round_
            and not self.job.stopping
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(REFILL_POLL)
        if self.job.stopping:
            raise RuntimeError("the job is stopping")

    def situation(self, but: str | None = None) -> Situation:
        return Situation(
            restarts=self.restarts,
            training=self.job.training,
            stopping=self.job.stopping,
            nodes_left=self.fleet.alive(but=but) + self.fleet.replacing(),
            preflight_replaced=self.preflight_replaced,
            crashes=self.crashes,
            stepped=self.job.steps_known or bool(self._stepped),
        )

    def report(
        self,
        fault: Fault,
        type_: FaultType,
        source: Source,
        before: Callable[[Decision], None] | None = None,
    ) -> Decision:
        node = self.fleet.nodes[fault.node]
        crashes = tuple(c for c in fault.crashes if c.round not in self._stepped)
        event = NodeFault(
            type=type_,
            source=source,
            node=node.node_id,
            host=node.host,
            detail=fault.detail,
            reason=fault.reason,
            in_world=node.node_id in self.rounds.world,
            node_gone=node.phase.gone,
            crashes=crashes,
        )
        decision = decide(self.rules, self.situation(but=node.node_id), event)
        self.crashes = remember(self.crashes, crashes)
        fault.action = decision.action
        if before is not None:
            before(decision)
        node.step = max(node.step, fault.last_step)
        self.job.saw_step(fault.last_step)
        if decision.remove:
            self._take_out(node, fault.detail)
        if decision.record:
            self.faults.append(fault)
        if decision.act is Act.STOP:
            self.job.stop(decision.reason, decision.cause or StopCause.INTERRUPTED)
            return decision
        if decision.restart:
            self._restart(fault)
        if decision.act is Act.REPLACE:
            if source in PREFLIGHT_SOURCES:
                self.preflight_replaced += 1
            self.replace(node, decision.exclude_host)
        elif decision.act is Act.SHRINK:
            self.fleet.background(self._release(node, fault))
        return decision

    def node_lost(self, node: Node, why: str) -> None:
        """The node's agent ended, or went silent: a fault of the node (class ``node``),
        though nothing says its host is bad (it is not excluded)."""
        if node.node_id in self.rounds.world:
            self.job.sample_last(node)  # the step it got to, before its fault
        fault = Fault(
            kind="node_lost",
            node=node.node_id,
            detail=f"node {node.node_id} ({node.host}) lost: {why}",
            time=time.time(),
            action="",
            last_step=node.step,
            fault_class=FaultClass.NODE.value,
            reason=why,
            lower_bound=not node.attached,
        )
        self.timeline.emit(
            events.FaultDetected(
                fault="node_lost", fault_class=FaultClass.NODE, reason=why, host=node.host
            ),
            fault.detail,
            node=node.node_id,
        )
        self.report(fault, FaultType.LOST, Source.AGENT)

    def _take_out(self, node: Node, why: str) -> None:
        if node.phase.gone:
            return
        node.phase = NodePhase.LOST
        self.job.fence_out(node)
        self.rounds.leave(node.node_id)
        node.send(Action(kind="exit", reason=why))

    def _restart(self, fault: Fault) -> None:
        self.restarts += 1
        round_now = self.job.open_round()
        fault.restart_round = round_now
        restart = Action(kind="restart", round=round_now, reason=fault.detail)  # frozen: one
        for node in self.fleet.nodes.values():
            # A node standing by runs nothing: its held join goes on into the round just
            # opened. Told to restart as well, it would stop the workers it starts there.
            if node.phase.gone or node.phase in (NodePhase.LAUNCHED, NodePhase.STANDBY):
                continue
            node.send(restart)
        self.timeline.emit(
            events.WorkersRestarted(
                round=round_now,
                cause="fault",
                fault=fault.kind,
                restart=self.restarts,
                max_restarts=self.rules.max_restarts,
            ),
            f"restart {self.restarts}/{self.rules.max_restarts}: {fault.action} "
            f"after {fault.detail}",
            node=fault.node,
        )

    async def _replaced(self, node: Node, answer: Awaitable[Node], exclude_host: bool) -> None:
        try:
            new = await answer
        except Exception as exc:
            self.replacing.pop(node.node_id, None)
            if self.job.stopping:
                return  # the job ended meanwhile and interrupted the scheduler: no news
            log.warning("node replacement failed", node=node.node_id, error=str(exc))
            now = self.situation()
            decision = decide(self.rules, now, ReplacementFailed(node.node_id, str(exc)))
            self.timeline.emit(
                events.NodeReplacementFailed(
                    host=node.host,
                    error=str(exc),
                    nodes_left=now.nodes_left,
                    action=decision.action,
                ),
                f"replacing {node.node_id} failed: {exc}; {decision.action}",
                node=node.node_id,
            )
            if decision.act is Act.STOP:
                self.job.stop(decision.reason, decision.cause or StopCause.TOO_FEW_NODES)
            return
        self.replacing.pop(node.node_id, None)
        if self.job.stopping:
            return
        if exclude_host:
            self.excluded.add(node.host)
            self.timeline.emit(
                events.NodeExcluded(host=node.host),
                f"host {node.host} excluded (node {node.node_id})",
                node=node.node_id,
            )
        self.timeline.emit(
            events.NodeReplaced(
                host=node.host,
                replacement=new.node_id,
                replacement_host=new.host,
                excluded_host=node.host if exclude_host else None,
            ),
            (
                f"node {node.node_id} replaced by {new.node_id} on {new.host}"
                if new.node_id != node.node_id
                # A scheduler of nodes started outside keeps the slot open for the same node.
                else f"node {node.node_id}'s slot is kept open for it to come back to {new.host}"
            ),
            node=node.node_id,
        )

    async def _release(self, node: Node, fault: Fault) -> None:
        await self.fleet.release(node)
        self.timeline.emit(
            events.NodeRemoved(host=node.host, reason=fault.action),
            f"node {node.node_id} ({node.host}) stopped, not replaced: {fault.action}",
            node=node.node_id,
        )

    # -- what became of the faults -----------------------------------------------------------

    def progressed(self, step: int) -> None:
        """A node that joins says how far training got: the survivors know best."""
        for fault in self.faults:
            if fault.recovered_at is None:
                fault.last_step = max(fault.last_step, step)

    def restored(self, round_: int, where: str) -> None:
        for fault in self.faults:
            if fault.restart_round == round_:
                fault.restored_from = where

    def first_step(self, round_: int, at: float, first: int | None) -> None:
        """Round ``round_`` completed its first step (``first``) at ``at``: the faults that
        restarted it are recovered."""
        if round_ not in self._stepped:  # a failure reported first was no crash loop's
            self._stepped.add(round_)
            self.crashes = tuple(c for c in self.crashes if c.round != round_)
        for fault in self.faults:
            if fault.restart_round == round_ and fault.recovered_at is None:
                fault.recovered_at = at
                fault.first_step_after = first
                if fault.restored_from == "storage" and first is not None:
                    # Training goes on after the step it restored, as steps_lost counts it.
                    fault.restored_from = (
                        f"storage (step {first - 1})" if first > 0 else "storage (no step)"
                    )
                recovery_s = fault.recovery_s or 0.0
                self.timeline.emit(
                    events.Recovered(
                        fault=fault.kind,
                        round=round_,
                        recovery_s=recovery_s,
                        steps_lost=fault.steps_lost,
                    ),
                    f"recovered from {fault.kind} in {recovery_s:.2f}s",
                    node=fault.node,
                )

    @property
    def downtime_s(self) -> float:
        return sum(f.recovery_s or 0.0 for f in self.faults)
