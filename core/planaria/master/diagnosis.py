"""The master's side of diagnosis: classified worker faults, hangs, stragglers, unhealthy nodes.

Each finding becomes a timeline event and, where it may call for an action, a fault the job
decides on (:meth:`JobControl.report_fault`, by :mod:`planaria.master.policy`): restart in place
(a transient fault, a hang), replace the node and exclude its host (a node fault, a failed
health check, a straggler when ``replace_stragglers``), or stop (a user error when
``on_user_error: stop``, a crash loop, and always workers that cannot start).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from planaria import events, process
from planaria.diagnosis.classify import exception_line
from planaria.diagnosis.messages import HangReport, HealthReport
from planaria.diagnosis.policy import DiagnosisPolicy
from planaria.diagnosis.stragglers import RankTimes, Straggler, StragglerDetector
from planaria.fault_pattern.api import Classification, FaultClass
from planaria.log import get_logger
from planaria.master.control import JobControl
from planaria.master.policy import CANNOT_START, Crash, Decision, FaultType, Source
from planaria.master.state import Node
from planaria.master.summary import FailedRank, Fault, Summary, tail_of
from planaria.protocol import ChaosReport, Heartbeat, WorkerFailure, WorkersReport

log = get_logger("master.diagnosis")

START = "start"
"""The ``source`` of a verdict on workers that never started (:attr:`WorkerFailure.start_error`):
the program, its environment or the node's size is wrong, which no restart cures."""

_TYPES = {
    FaultClass.NODE: FaultType.NODE,
    FaultClass.TRANSIENT: FaultType.TRANSIENT,
    FaultClass.USER: FaultType.USER,
}


def last_words(failure: WorkerFailure) -> str:
    """What tells one crash from another: the last exception line of the worker's traceback,
    else how it ended (``exit code 1``, ``killed by SIGKILL``: a signal says more than a
    traceback it may have printed before)."""
    if failure.signal is None:
        line = exception_line(failure.log_tail)
        if line:
            return line
    return failure.description


def signal_name(number: int | None) -> str | None:
    """``SIGKILL`` for 9 (:func:`planaria.process.signal_name`); None for no signal."""
    return None if number is None else process.signal_name(number)


def stopped_on_start(summary: Summary) -> bool:
    """Whether the job stopped because its workers cannot start: a mistake in what it asks,
    like a bad config (``planaria run`` exits 2 for both)."""
    return any(fault.action == CANNOT_START for fault in summary.faults)


class Diagnosis:
    def __init__(self, job: JobControl, policy: DiagnosisPolicy) -> None:
        self.job = job
        self.policy = policy
        self.detector = StragglerDetector(policy.straggler_factor)
        self.stragglers: list[Straggler] = []
        self._times: dict[int, RankTimes] = {}
        self._times_round = -1
        self._times_changed = False
        self._checked_at = -float("inf")
        self.failed_rank: FailedRank | None = None
        """The last worker failure that drove a fault: the summary of a failed job shows it."""

    # -- worker faults ----------------------------------------------------------------------

    def classify(self, failure: WorkerFailure) -> Classification:
        if failure.start_error is not None:
            return Classification(FaultClass.USER, "the workers cannot start", START, "")
        return self.policy.classifier.classify(failure.exitcode, failure.signal, failure.log_tail)

    def driver(self, failures: list[WorkerFailure]) -> tuple[WorkerFailure, Classification]:
        """The failure that decides the action: a node fault among them, else the first."""
        verdicts = [(f, self.classify(f)) for f in failures]
        return next((fv for fv in verdicts if fv[1].kind is FaultClass.NODE), verdicts[0])

    def workers_failed(self, node: Node, report: WorkersReport, *, current: bool) -> None:
        """A node's workers failed. Peers of a failed worker fail too, often before its own
        report arrives: every failure goes into the timeline, and the one that decides (a
        node fault among them, else the first) is the fault. Failures of a round restarted
        already (``current`` false) only matter when they show a bad node (the restart that
        came first was for a peer's symptom), or crashes before any step, which the next
        round's may repeat (a crash loop)."""
        assert report.failure is not None
        failures = [report.failure, *report.also]
        failure, verdict = self.driver(failures)
        detail = ""
        for each in failures:
            main = current and each is failure
            text = self._failure_event(node, report.round, each, secondary=not main)
            detail = text if each is failure else detail
        crashes: tuple[Crash, ...] = ()
        if report.last_step < 0:  # none of the node's workers completed a step in the round
            # A replica that could not be fetched is no error of the workers (they never
            # started): the next round goes without it, and it is no crash loop's.
            crashes = tuple(
                Crash(f.rank, last_words(f), report.round, signal=signal_name(f.signal))
                for f in failures
                if f.replica_error is None
            )
        if not current and verdict.kind is not FaultClass.NODE and not crashes:
            return
        self.failed_rank = FailedRank(
            rank=failure.rank,
            node=node.node_id,
            description=failure.description,
            log=failure.log_path or "",
            tail=tail_of(failure.start_error or failure.log_tail),
        )
        if not current and verdict.kind is FaultClass.NODE:
            log.warning("node fault found after the restart", node=node.node_id, round=report.round)
        fault = Fault(
            kind="worker_failed",
            node=node.node_id,
            rank=failure.rank,
            detail=detail,
            time=failure.time,
            action="",
            last_step=report.last_step if current else -1,
            fault_class=verdict.kind.value,
            reason=verdict.reason,
            crashes=crashes,
        )
        source = Source.START if verdict.source == START else Source.WORKERS
        self.job.report_fault(fault, _TYPES[verdict.kind], source if current else Source.LATE)

    def _failure_event(
        self, node: Node, round_: int, failure: WorkerFailure, *, secondary: bool
    ) -> str:
        detail = f"rank {failure.rank} (node {node.node_id}) {failure.description}"
        verdict = self.classify(failure)
        self.job.emit(
            events.FaultDetected(
                fault="worker_failed",
                fault_class=verdict.kind.value,
                reason=verdict.reason,
                matched=verdict.line,
                classified_by=verdict.source,
                secondary=secondary,
                round=round_,
                exitcode=failure.exitcode,
                signal=failure.signal,
                log_tail=failure.log_tail,
                host=node.host,
            ),
            f"{detail} (also in round {round_})" if secondary else detail,
            node=node.node_id,
            rank=failure.rank,
        )
        return detail

    def chaos(self, report: ChaosReport) -> None:
        """A fault injected on purpose is about to fire: the timeline says so first."""
        node = self.job.heard_from(report.node_id)  # a node the job knows, as for every report
        # The step it fired at: a node killed now is lost there, not at its last heartbeat's.
        node.step = max(node.step, report.step)
        self.job.saw_step(report.step)
        at = f" at step {report.step}" if report.step >= 0 else ""
        self.job.emit(
            events.FaultDetected(fault="chaos", rule=report.rule.model_dump(mode="json")),
            f"chaos: {report.rule.kind} on node {report.node_id}{at}",
            node=report.node_id,
            step=report.step if report.step >= 0 else None,
        )

    # -- hangs ------------------------------------------------------------------------------

    def hang(self, report: HangReport) -> None:
        job = self.job
        node = job.heard_from(report.node_id)
        current = report.round == job.round and job.training and node.node_id in job.world
        ranks = ", ".join(str(r.rank) for r in report.ranks)
        what = (
            f"no first step within {report.timeout:g}s"
            if report.first_step
            else f"no step progress for {report.timeout:g}s"
        )
        detail = f"hang on node {node.node_id}: {what} (rank(s) {ranks})"
        job.emit(
            events.HangDetected(
                secondary=not current,
                round=report.round,
                timeout=report.timeout,
                first_step=report.first_step,
                ranks=list(report.ranks),
            ),
            detail if current else f"{detail} (also in round {report.round})",
            node=node.node_id,
        )
        if not current:
            return
        steps = [r.step for r in report.ranks if r.step >= 0]
        fault = Fault(
            kind="hang",
            node=node.node_id,
            detail=detail,
            time=report.time,
            action="",
            last_step=max(steps, default=-1),
            fault_class=FaultClass.TRANSIENT.value,
            reason=what,
        )
        job.report_fault(fault, FaultType.HANG, Source.WATCHDOG)

    # -- health checks ----------------------------------------------------------------------

    def unhealthy(self, report: HealthReport) -> None:
        node = self.job.heard_from(report.node_id)
        checks = ", ".join(f"{f.check} ({f.status})" for f in report.failures)
        detail = f"node {node.node_id} ({node.host}) failed its health checks: {checks}"
        self.job.emit(
            events.HealthChecked(healthy=False, host=node.host, failures=list(report.failures)),
            detail,
            node=node.node_id,
        )
        fault = Fault(
            kind="unhealthy",
            node=node.node_id,
            detail=detail,
            time=report.time,
            action="",
            last_step=node.step,
            fault_class=FaultClass.NODE.value,
            reason="; ".join(f"{f.check}: {f.detail}" for f in report.failures)[:500],
        )
        self.job.report_fault(fault, FaultType.NODE, Source.HEALTH_CHECK)

    # -- stragglers -------------------------------------------------------------------------

    def progress(self, node: Node, beat: Heartbeat) -> None:
        job = self.job
        info = job.world.get(node.node_id)
        if info is None or beat.round != job.round or not job.training:
            return
        if self._times_round != beat.round:
            self._times, self._times_round = {}, beat.round
        for p in beat.progress:
            if p.step_s is not None or p.busy_s is not None:
                rank = info.rank_offset + p.local_rank
                self._times[rank] = RankTimes(node.node_id, p.local_rank, p.step_s, p.busy_s)
        self._times_changed = True

    def check_stragglers(self, now: float, every: float) -> None:
        """Compare the ranks' step times, at most once per ``every`` seconds (the heartbeat
        interval) and only when a heartbeat brought new ones: per heartbeat, a job of n nodes
        would pay n times the O(n log n) comparison."""
        # A large job is checked less often: the sort stays well under 1% of the master's time.
        every = max(every, len(self._times) / 2000)
        if self._times_round != self.job.round or not self.job.training:
            return  # the times are an earlier round's: its ranks may be others now
        if not self._times_changed or now - self._checked_at < every:
            return
        world = next(iter(self.job.world.values()), None)
        if world is None or len(self._times) < world.world_size:
            return
        self._times_changed, self._checked_at = False, now
        for straggler in self.detector.check(self._times):
            self._flag(straggler)

    def step_times(self) -> Mapping[int, RankTimes]:
        """The current round's ranks by global rank, each with its latest step-time medians
        (what the straggler check compares); empty until its heartbeats bring them."""
        return self._times if self._times_round == self.job.round else {}

    def _flag(self, straggler: Straggler) -> None:
        self.stragglers.append(straggler)
        node = self.job.nodes[straggler.node]
        fault = Fault(
            kind="straggler",
            node=node.node_id,
            rank=straggler.rank,
            detail=straggler.describe(),
            time=time.time(),
            action="",
            last_step=node.step,
            fault_class=FaultClass.NODE.value,
            reason=f"{straggler.metric} time {straggler.ratio:.1f}x the other ranks' median",
        )

        def announce(decision: Decision) -> None:
            self.job.emit(
                events.StragglerDetected(
                    metric=straggler.metric,
                    seconds=straggler.seconds,
                    others_s=straggler.others_s,
                    ratio=straggler.ratio,
                    factor=self.policy.straggler_factor,
                    action=decision.action,
                    host=node.host,
                ),
                straggler.describe(),
                node=straggler.node,
                rank=straggler.rank,
            )

        self.job.report_fault(fault, FaultType.NODE, Source.STRAGGLER, before=announce)
