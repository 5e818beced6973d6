"""The master's side of diagnosis: classified worker faults, hangs, stragglers, unhealthy nodes.

Each finding becomes a timeline event and, where it calls for one, an action through the
master's own policy: restart in place (a transient fault, a hang), replace the node and exclude
its host (a node fault, a failed health check, a straggler when ``replace_stragglers``), or stop
(a user error when ``on_user_error: stop``, and always workers that cannot start).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from planaria.diagnosis.messages import HangReport, HealthReport
from planaria.diagnosis.policy import DiagnosisPolicy
from planaria.diagnosis.stragglers import RankTimes, Straggler, StragglerDetector
from planaria.events import EventKind
from planaria.fault_pattern.api import Classification, FaultClass
from planaria.log import get_logger
from planaria.master.timeline import Fault, Summary
from planaria.protocol import Heartbeat, WorkerFailure

if TYPE_CHECKING:
    from planaria.master.job import Master, Node

log = get_logger("master.diagnosis")

START = "start"
"""The ``source`` of a verdict on workers that never started (:attr:`WorkerFailure.start_error`):
the program, its environment or the node's size is wrong, which no restart cures."""
CANNOT_START = "stop: the workers cannot start, and a restart would fail the same way"


def stopped_on_start(summary: Summary) -> bool:
    """Whether the job stopped because its workers cannot start: a mistake in what it asks,
    like a bad config (``planaria run`` exits 2 for both)."""
    return any(fault.action == CANNOT_START for fault in summary.faults)


class Diagnosis:
    def __init__(self, master: Master, policy: DiagnosisPolicy) -> None:
        self.master = master
        self.policy = policy
        self.detector = StragglerDetector(policy.straggler_factor)
        self.stragglers: list[Straggler] = []
        self._times: dict[int, RankTimes] = {}
        self._times_round = -1

    # -- worker faults ----------------------------------------------------------------------

    def classify(self, failure: WorkerFailure) -> Classification:
        if failure.start_error is not None:
            return Classification(FaultClass.USER, "the workers cannot start", START, "")
        return self.policy.classifier.classify(failure.exitcode, failure.signal, failure.log_tail)

    def event_fields(self, failure: WorkerFailure) -> dict[str, object]:
        verdict = self.classify(failure)
        return {
            "fault_class": verdict.kind.value,
            "reason": verdict.reason,
            "matched": verdict.line,
            "classified_by": verdict.source,
        }

    def driver(self, failures: list[WorkerFailure]) -> tuple[WorkerFailure, Classification]:
        """The failure that decides the action: a node fault among them, else the first."""
        verdicts = [(f, self.classify(f)) for f in failures]
        return next((fv for fv in verdicts if fv[1].kind is FaultClass.NODE), verdicts[0])

    def act(self, node: Node, fault: Fault, verdict: Classification) -> None:
        """The action for a worker fault of the running round."""
        from planaria.master.job import JobState

        fault.fault_class, fault.reason = verdict.kind.value, verdict.reason
        if verdict.kind is FaultClass.NODE:
            fault.action = f"replace the node, exclude host {node.host}"
            self.master._lose_node(node, fault, exclude_host=True)
        elif verdict.source == START:
            fault.action = CANNOT_START
            self.master.faults.append(fault)
            self.master._finish(JobState.FAILED, f"user error: {fault.detail}")
        elif verdict.kind is FaultClass.USER and self.policy.on_user_error == "stop":
            fault.action = "stop (diagnosis.on_user_error: stop)"
            self.master.faults.append(fault)
            self.master._finish(JobState.FAILED, f"user error: {fault.detail}: {verdict.reason}")
        else:
            self.master._restart(fault)

    def late_failures(self, node: Node, round_: int, failures: list[WorkerFailure]) -> None:
        """Failures reported after their round was restarted: a node fault among them still
        takes the node out (the restart that came first was for a peer's symptom)."""
        if node.phase.gone:
            return
        failure, verdict = self.driver(failures)
        if verdict.kind is not FaultClass.NODE:
            return
        fault = Fault(
            kind="worker_failed",
            node=node.node_id,
            rank=failure.rank,
            detail=f"rank {failure.rank} (node {node.node_id}) {failure.description}",
            time=failure.time,
            action=f"replace the node, exclude host {node.host}",
            fault_class=verdict.kind.value,
            reason=verdict.reason,
        )
        log.warning("node fault found after the restart", node=node.node_id, round=round_)
        self.master._lose_node(node, fault, exclude_host=True)

    # -- hangs ------------------------------------------------------------------------------

    def hang(self, report: HangReport) -> None:
        from planaria.master.job import JobState

        master = self.master
        node = master._touch(report.node_id)
        current = (
            report.round == master.rounds.round
            and master.state is JobState.RUNNING
            and node.node_id in master.rounds.world
        )
        ranks = ", ".join(str(r.rank) for r in report.ranks)
        what = (
            f"no first step within {report.timeout:g}s"
            if report.first_step
            else f"no step progress for {report.timeout:g}s"
        )
        detail = f"hang on node {node.node_id}: {what} (rank(s) {ranks})"
        master.timeline.emit(
            EventKind.HANG_DETECTED,
            detail if current else f"{detail} (also in round {report.round})",
            node=node.node_id,
            fault="hang",
            fault_class=FaultClass.TRANSIENT.value,
            secondary=not current,
            round=report.round,
            ranks=[r.model_dump(mode="json") for r in report.ranks],
        )
        if not current:
            return
        steps = [r.step for r in report.ranks if r.step >= 0]
        fault = Fault(
            kind="hang",
            node=node.node_id,
            detail=detail,
            time=report.time,
            action="restart workers in place",
            last_step=max(steps, default=-1),
            fault_class=FaultClass.TRANSIENT.value,
            reason=what,
        )
        node.step = max(node.step, fault.last_step)
        master._restart(fault)

    # -- health checks ----------------------------------------------------------------------

    def unhealthy(self, report: HealthReport) -> None:
        master = self.master
        node = master._touch(report.node_id)
        checks = ", ".join(f"{f.check} ({f.status})" for f in report.failures)
        detail = f"node {node.node_id} ({node.host}) failed its health checks: {checks}"
        master.timeline.emit(
            EventKind.HEALTH_CHECKED,
            detail,
            node=node.node_id,
            healthy=False,
            host=node.host,
            failures=[f.model_dump(mode="json") for f in report.failures],
        )
        if node.phase.gone or master.state.terminal:
            return
        fault = Fault(
            kind="unhealthy",
            node=node.node_id,
            detail=detail,
            time=report.time,
            action=f"replace the node, exclude host {node.host}",
            last_step=node.step,
            fault_class=FaultClass.NODE.value,
            reason="; ".join(f"{f.check}: {f.detail}" for f in report.failures)[:500],
        )
        master._lose_node(node, fault, exclude_host=True)

    # -- stragglers -------------------------------------------------------------------------

    def progress(self, node: Node, beat: Heartbeat) -> None:
        from planaria.master.job import JobState

        master = self.master
        info = master.rounds.world.get(node.node_id)
        if (
            info is None
            or beat.round != master.rounds.round
            or master.state is not JobState.RUNNING
        ):
            return
        if self._times_round != beat.round:
            self._times, self._times_round = {}, beat.round
        for p in beat.progress:
            if p.step_s is not None or p.busy_s is not None:
                rank = info.rank_offset + p.local_rank
                self._times[rank] = RankTimes(node.node_id, p.local_rank, p.step_s, p.busy_s)
        if len(self._times) < info.world_size:
            return
        for straggler in self.detector.check(self._times):
            self._flag(straggler)

    def _flag(self, straggler: Straggler) -> None:
        master = self.master
        self.stragglers.append(straggler)
        node = master.nodes[straggler.node]
        replace = self.policy.replace_stragglers and not node.phase.gone
        master.timeline.emit(
            EventKind.STRAGGLER_DETECTED,
            straggler.describe(),
            node=straggler.node,
            rank=straggler.rank,
            metric=straggler.metric,
            seconds=straggler.seconds,
            others_s=straggler.others_s,
            ratio=straggler.ratio,
            factor=self.policy.straggler_factor,
            action="replace the node" if replace else "none (diagnosis.replace_stragglers: false)",
        )
        if not replace:
            return
        fault = Fault(
            kind="straggler",
            node=node.node_id,
            rank=straggler.rank,
            detail=straggler.describe(),
            time=time.time(),
            action=f"replace the node, exclude host {node.host}",
            last_step=node.step,
            fault_class=FaultClass.NODE.value,
            reason=f"{straggler.metric} time {straggler.ratio:.1f}x the other ranks' median",
        )
        master._lose_node(node, fault, exclude_host=True)
