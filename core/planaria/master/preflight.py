"""The master's side of the pre-flight node check: groups, orders, results, verdicts, actions.

Before the first training round, every agent (once healthy) long-polls ``/preflight/next``.
The session gathers the nodes the way a rendezvous round does (all of them, or at least ``min``
once nobody came for ``join_grace``), hands each node an order to run the benchmark in a group,
collects the results (``/preflight/result``; a result that does not come by the group's
deadline is a timeout), and judges them with :mod:`planaria.diagnosis.preflight`: round 1, then
round 2 for the suspects only. Faulty nodes are excluded and replaced; their replacements, and
nodes that came late, are checked next to a known-good node before anyone trains. Then the
nodes are told ``done`` and the master opens the first rendezvous round.

A node that registers once training runs (a replacement at run time) skips the pre-flight: the
health checks still gate every round it joins.

Why one module: one session's state machine (gathering, round 1, round 2, newcomers) and the
events that tell it, which read best together; its judgement is pure and lives apart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from planaria import events
from planaria.diagnosis.messages import (
    PreflightOrder,
    PreflightPoll,
    PreflightResult,
    PreflightTask,
)
from planaria.diagnosis.policy import PreflightPolicy
from planaria.diagnosis.preflight import (
    NEWCOMER,
    Outcome,
    PreflightReport,
    Verdict,
    baseline,
    groups_of,
    judge,
    regroup,
    slowest_per_measure,
    suspects_of,
)
from planaria.events import StopCause
from planaria.fault_pattern.api import FaultClass
from planaria.log import get_logger
from planaria.master.control import JobControl
from planaria.master.policy import Decision, FaultType, Source
from planaria.master.state import Conflict, Node, NodePhase
from planaria.master.summary import Fault

log = get_logger("master.preflight")

GRACE = 10.0
"""How long after its benchmark's timeout a group's results may still arrive."""


@dataclass
class _Group:
    name: str
    stage: str
    members: list[str]
    deadline: float
    aborted: str = ""
    """Why the members still running should stop: a member failed, the group cannot pass."""
    results: dict[str, Outcome] = field(default_factory=dict)
    raw: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.results) == len(self.members)


class Preflight:
    def __init__(self, job: JobControl, policy: PreflightPolicy) -> None:
        self.job = job
        self.policy = policy
        self.stage = "gathering"
        self.finished = not policy.enabled
        self.started = time.time()
        self.last_arrival = self.started
        self.settled_at = 0.0
        self.arrived: dict[str, float] = {}
        self.offers: dict[str, tuple[str, int]] = {}
        self.orders: dict[str, PreflightTask] = {}
        self.groups: dict[str, _Group] = {}
        self.closed: list[_Group] = []
        self.good: list[str] = []
        self.checked: set[str] = set()
        self.first_why: dict[str, str] = {}
        self.pool: list[Outcome] = []
        """What the known-good nodes measured: the yardstick of round 2 and newcomers."""
        self.report = PreflightReport()
        self._numbers = 0
        self._judged: set[str] = set()

    # -- requests ---------------------------------------------------------------------------

    def busy(self, node_id: str) -> bool:
        """Whether the node is running a benchmark (and so not polling)."""
        return any(node_id in g.members and node_id not in g.results for g in self.groups.values())

    async def next(self, poll: PreflightPoll, hold: float) -> PreflightOrder:
        job = self.job
        node = job.heard_from(poll.node_id)
        if poll.running is not None:
            return await self._watch(node, poll.running, hold)
        self.offers[poll.node_id] = (poll.addr, poll.port)
        now = time.time()
        if not self.finished and poll.node_id not in self.arrived:
            self.arrived[poll.node_id] = self.last_arrival = now
            node.phase = NodePhase.PREFLIGHT
            self.tick(now)
        deadline = now + hold
        while True:
            if job.stopping or node.phase.gone:
                return PreflightOrder(state="exit", reason=job.stop_reason or "replaced")
            task = self.orders.pop(poll.node_id, None)
            if task is not None:
                return PreflightOrder(state="run", task=task)
            if self.finished:
                return PreflightOrder(state="done")
            remaining = deadline - time.time()
            if remaining <= 0:
                return PreflightOrder(state="wait", reason=f"pre-flight: {self.stage}")
            node.wake.clear()
            await node.wake.wait(remaining)

    async def _watch(self, node: Node, name: str, hold: float) -> PreflightOrder:
        """A node running its benchmark asks whether to go on: ``abort`` once a member of
        its group failed (its peers would only wait for it until the timeout)."""
        deadline = time.time() + hold
        while True:
            group = self.groups.get(name)
            if group is None or group.aborted or self.job.stopping:
                why = group.aborted if group else "the group was closed"
                return PreflightOrder(state="abort", reason=why)
            remaining = deadline - time.time()
            if remaining <= 0:
                return PreflightOrder(state="wait")
            node.wake.clear()
            await node.wake.wait(remaining)

    def result(self, result: PreflightResult) -> None:
        self.job.heard_from(result.node_id)
        group = self.groups.get(result.group)
        if group is None or result.node_id not in group.members:
            if any(g.name == result.group for g in self.closed):
                return  # late: the group was judged without it (a timeout)
            raise Conflict(f"no pre-flight group {result.group!r} with node {result.node_id!r}")
        group.results[result.node_id] = Outcome(
            result.node_id, result.status, dict(result.measures), result.error
        )
        group.raw[result.node_id] = result.model_dump(mode="json", exclude={"node_id", "group"})
        if result.status != "ok" and not group.aborted:
            group.aborted = f"{result.node_id} {result.status}: {result.error}"[:300]
            for member in group.members:
                self.job.nodes[member].wake.set()
        self.tick(time.time())

    # -- the session ------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        if self.finished or self.job.stopping:
            return
        for group in list(self.groups.values()):
            for member in group.members:
                if member not in group.results and self._gone(member):
                    group.results[member] = Outcome(member, "lost", {}, "the node was lost")
            if group.complete or now > group.deadline:
                self._close(group)
        if self.groups:
            return
        if self.stage == "gathering":
            self._gather(now)
        elif self.stage == "round 1":
            self._after_round_1(now)
        elif self.stage == "round 2":
            self._after_round_2(now)
        else:
            self._newcomers(now)

    def _gone(self, node_id: str) -> bool:
        node = self.job.nodes.get(node_id)
        return node is None or node.phase.gone

    def _gather(self, now: float) -> None:
        settings = self.job.settings
        expected = {n.node_id for n in self.job.nodes.values() if not n.phase.gone}
        here = [n for n in self.arrived if n in expected]
        everyone = bool(here) and expected <= set(here)
        enough = len(here) >= settings.min_nodes and now - self.last_arrival >= settings.join_grace
        if everyone or enough:
            self._start("round 1", groups_of(here))
        elif now - self.started > settings.join_timeout:
            self.job.stop(
                f"pre-flight: {len(here)} node(s) came within {settings.join_timeout:g}s, at "
                f"least {settings.min_nodes} needed",
                StopCause.JOIN_TIMEOUT,
            )

    def _after_round_1(self, now: float) -> None:
        groups = self._stage_groups("round 1")
        outcomes = [[g.results[m] for m in g.members] for g in groups]
        self.report.baseline = baseline(o for group in outcomes for o in group)
        good, suspects = suspects_of(outcomes, self.policy.factor)
        self.pool = [o for group in outcomes for o in group if o.node in good]
        self.good = [n for n in good if not self._gone(n)]
        self.checked.update(good)
        self.first_why = suspects
        self._round_event("round 1", groups, suspects=suspects)
        # Failed groups first: they need a good partner to test the collective; a slow node's
        # compute is timed alone just as well.
        left = sorted(
            (n for n in suspects if not self._gone(n)), key=lambda n: suspects[n].startswith("slow")
        )
        if left:
            self._start("round 2", regroup(left, self.good))
        else:
            self._settle(now)

    def _after_round_2(self, now: float) -> None:
        groups = self._stage_groups("round 2")
        verdicts = [self._verdict(g, self.first_why[g.members[-1]]) for g in groups]
        self._round_event("round 2", groups, verdicts=verdicts)
        for verdict in verdicts:
            self._act(verdict)
        self._settle(now)

    def _newcomers(self, now: float) -> None:
        for group in self._stage_groups(NEWCOMER, fresh=True):
            verdict = self._verdict(group, NEWCOMER)
            self._round_event(NEWCOMER, [group], verdicts=[verdict])
            self._act(verdict)
        waiting = [n for n in self.arrived if n not in self.checked and not self._gone(n)]
        if waiting:
            good = [n for n in self.good if not self._gone(n)]
            self._start(NEWCOMER, regroup(waiting, good))
            return
        coming = [
            n.node_id
            for n in self.job.nodes.values()
            if not n.phase.gone and n.node_id not in self.checked
        ]
        late = now - self.settled_at > self.job.settings.join_timeout
        if (coming or self.job.replacing()) and not late:
            return
        if coming:
            log.warning("pre-flight: nodes did not come; they skip it", nodes=coming)
        self._finish()

    def _verdict(self, group: _Group, first: str) -> Verdict:
        suspect = group.members[-1]
        partner = group.members[0] if len(group.members) > 1 else None
        if partner is not None and group.results[partner].ok:
            self.pool.append(group.results[partner])
        verdict = judge(group.results[suspect], self.pool, self.policy.factor, first, partner)
        if verdict.kind == "cleared":
            self.pool.append(group.results[suspect])
        return verdict

    def _settle(self, now: float) -> None:
        self.stage = NEWCOMER
        self.settled_at = now
        self._newcomers(now)

    def _stage_groups(self, stage: str, fresh: bool = False) -> list[_Group]:
        groups = [g for g in self.closed if g.stage == stage]
        if fresh:
            groups = [g for g in groups if g.name not in self._judged]
            self._judged.update(g.name for g in groups)
        return groups

    def _start(self, stage: str, groups: list[list[str]]) -> None:
        self.stage = stage
        if stage != NEWCOMER:
            self.report.rounds += 1
        spec = self.policy.benchmark
        assert spec is not None
        deadline = time.time() + spec.timeout + GRACE
        for members in groups:
            self._numbers += 1
            name = f"{stage.replace(' ', '')}.{self._numbers}"
            addr, port = self.offers[members[0]]
            self.groups[name] = _Group(name, stage, members, deadline)
            for rank, member in enumerate(members):
                self.orders[member] = PreflightTask(
                    group=name,
                    stage=stage,
                    members=members,
                    rank=rank,
                    master_addr=addr,
                    master_port=port,
                    benchmark=spec,
                )
                self.job.nodes[member].wake.set()
        log.info("pre-flight groups formed", stage=stage, groups=groups)

    def _close(self, group: _Group) -> None:
        del self.groups[group.name]
        for member in group.members:
            self.orders.pop(member, None)
            if member not in group.results:
                timeout = self.policy.benchmark.timeout if self.policy.benchmark else 0.0
                group.results[member] = Outcome(
                    member, "timeout", {}, f"no result within {timeout + GRACE:g}s"
                )
        self.closed.append(group)

    # -- verdicts ---------------------------------------------------------------------------

    def _act(self, verdict: Verdict) -> None:
        self.checked.add(verdict.node)
        node = self.job.nodes[verdict.node]
        self.report.verdicts.append(verdict)
        self.report.hosts[verdict.node] = node.host
        if node.phase.gone:
            self.report.actions[verdict.node] = "none (the node was lost meanwhile)"
            return
        if verdict.kind == "cleared":
            self.good.append(verdict.node)
            self.report.actions[verdict.node] = "none"
            return
        what = "failed" if verdict.kind == "faulty" else "is slow in"
        fault = Fault(
            kind="preflight",
            node=node.node_id,
            detail=f"node {node.node_id} ({node.host}) {what} the pre-flight check: "
            + verdict.detail,
            time=time.time(),
            action="",
            fault_class="node",
            reason=f"pre-flight: {verdict.kind}",
        )

        def announce(decision: Decision) -> None:
            self._announce(node, fault, verdict, decision)

        source = Source.PREFLIGHT if verdict.kind == "faulty" else Source.PREFLIGHT_STRAGGLER
        decision = self.job.report_fault(fault, FaultType.NODE, source, before=announce)
        self.report.actions[node.node_id] = decision.action

    def _announce(self, node: Node, fault: Fault, verdict: Verdict, decision: Decision) -> None:
        if verdict.kind == "faulty":
            self.job.emit(
                events.FaultDetected(
                    fault="preflight",
                    fault_class=FaultClass.NODE,
                    reason=verdict.detail,
                    first=verdict.first,
                    host=node.host,
                ),
                fault.detail,
                node=node.node_id,
            )
            return
        slow = verdict.slow
        assert slow is not None
        self.job.emit(
            events.StragglerDetected(
                metric=slow.measure,
                seconds=slow.seconds,
                others_s=slow.baseline,
                ratio=slow.ratio,
                factor=self.policy.factor,
                action=decision.action,
                preflight=True,
                first=verdict.first,
                host=node.host,
            ),
            fault.detail,
            node=node.node_id,
        )

    # -- events -----------------------------------------------------------------------------

    def _round_event(
        self,
        stage: str,
        groups: list[_Group],
        suspects: dict[str, str] | None = None,
        verdicts: list[Verdict] | None = None,
    ) -> None:
        summary = "; ".join(
            f"{'+'.join(g.members)}: "
            + ", ".join(f"{o.node} {o.describe()}" for o in g.results.values())
            for g in groups
        )
        if suspects is not None:
            found = ", ".join(f"{n} ({why})" for n, why in suspects.items()) or "none"
            message = f"pre-flight {stage}: {len(groups)} group(s); suspects: {found}"
        else:
            found = ", ".join(f"{v.node} {v.kind}" for v in verdicts or [])
            message = f"pre-flight {stage}: {found}"
        self.job.emit(
            events.PreflightRound(
                stage=stage,
                groups=[
                    events.PreflightGroup(group=g.name, members=g.members, results=self._results(g))
                    for g in groups
                ],
                baseline=self.report.baseline,
                suspects=suspects or {},
                verdicts=[_verdict(v) for v in verdicts or []],
                results=summary,
            ),
            message,
        )

    @staticmethod
    def _results(group: _Group) -> dict[str, dict[str, Any]]:
        out = {}
        for node, outcome in group.results.items():
            raw = group.raw.get(node) or {"status": outcome.status, "error": outcome.error}
            out[node] = raw
        return out

    def _finish(self) -> None:
        self.finished = True
        self.stage = "done"
        report = self.report
        report.baseline = baseline(self.pool)
        report.slowest = slowest_per_measure(self.pool)
        report.nodes = len(self.checked)
        faulty = [v for v in report.verdicts if v.kind == "faulty"]
        slow = [v for v in report.verdicts if v.kind == "straggler"]
        cleared = [v for v in report.verdicts if v.kind == "cleared"]

        def names(vs: list[Verdict]) -> str:
            return ", ".join(f"{v.node} ({report.hosts[v.node]})" for v in vs) or "none"

        message = (
            f"pre-flight: {report.nodes} node(s) checked in {report.rounds} round(s); faulty: "
            f"{names(faulty)}; stragglers: {names(slow)}; cleared: {names(cleared)}"
        )
        self.job.emit(
            events.PreflightCompleted(
                nodes=sorted(self.checked),
                rounds=report.rounds,
                baseline=report.baseline,
                verdicts=[
                    _verdict(v, host=report.hosts[v.node], action=report.actions[v.node])
                    for v in report.verdicts
                ],
            ),
            message,
        )
        for node in self.job.nodes.values():
            node.wake.set()
        self.job.preflight_finished(passed=not faulty and not slow, message=message)


def _verdict(
    v: Verdict, host: str | None = None, action: str | None = None
) -> events.PreflightVerdict:
    slow = v.slow
    return events.PreflightVerdict(
        node=v.node,
        verdict=v.kind,
        detail=v.detail,
        first=v.first,
        metric=None if slow is None else slow.measure,
        seconds=None if slow is None else slow.seconds,
        ratio=None if slow is None else slow.ratio,
        host=host,
        action=action,
    )
