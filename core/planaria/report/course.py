"""A job's course, told from its timeline: each node's steps over time, each fault with its
detection, restart, restore and recovery, the checkpoints committed and the stragglers.

Pure: events in, a :class:`Course` out (times in seconds from the job's start), so that the
picture (:mod:`planaria.report.plot`) and the page (:mod:`planaria.report.page`) only draw.
The events are read once, as they come, and what is kept is bounded whatever the timeline's
length (a week of step samples, a thousand restarts): the samples are thinned to a fixed
number of points, and of the faults, rounds, stragglers and other events the last ones are
kept (the first ones too, for the events) and the rest counted.

Why one module: the course is made in one pass over the events (a long job's timeline is read
once, as it comes), and each part of it (the samples, the faults, the rounds) is a few lines
of that pass that read best beside the others.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from planaria.events import EventKind, JobEvent
from planaria.master.summary import Summary
from planaria.rundir import StepSample, finite


@dataclass
class Sample:
    time: float
    step: int


@dataclass
class LossSample:
    """Rank 0's training loss as a heartbeat brought it: at ``time``, the loss of ``step``."""

    time: float
    step: int
    loss: float


@dataclass
class TokenSample:
    """The job's tokens as a heartbeat of rank 0's node brought them: ``tokens`` processed
    so far (every round's) at ``time``, when that node was at ``step``."""

    time: float
    step: int
    tokens: float


POINTS = 400
"""Step samples kept a node (and checkpoints kept), spread over the whole job."""
INCIDENTS = 50
"""Faults told one by one: the last ones; the others are counted by kind."""
ROUNDS = 50
STRAGGLERS = 50
FIRST_EVENTS = 100
LAST_EVENTS = 400
"""Events listed: the first and the last ones; how many between them is said."""

T = TypeVar("T")


class Thinned(Generic[T]):
    """At most ``limit`` items of a stream, evenly spread over it, and its last one: when
    full, every other item goes and from then on only every other one comes in."""

    def __init__(self, limit: int = POINTS) -> None:
        self.limit = limit
        self.kept: list[T] = []
        self.stride = 1
        self.seen = 0
        self.last: T | None = None

    def add(self, item: T) -> None:
        if self.seen % self.stride == 0:
            self.kept.append(item)
            if len(self.kept) > self.limit:
                self.kept = self.kept[::2]
                self.stride *= 2
        self.seen += 1
        self.last = item

    def items(self) -> list[T]:
        if self.last is None or (self.kept and self.kept[-1] is self.last):
            return list(self.kept)
        return [*self.kept, self.last]


@dataclass
class Incident:
    """One fault and what became of it, as the timeline tells it."""

    number: int
    kind: str
    """``worker_failed``, ``node_lost`` or ``hang``."""
    where: str
    """``rank 1 on node-0``, ``node-1``."""
    detected: float
    message: str
    injected: float | None = None
    """When a fault injected on purpose (``chaos``) that this one follows was fired."""
    fault_class: str | None = None
    round: int | None = None
    """The round the restart opened."""
    restarted: float | None = None
    action: str = ""
    """What was done (from the summary)."""
    replaced_by: str | None = None
    restore: str | None = None
    """``memory:<step>`` or ``storage``."""
    restored: float | None = None
    """When the round that restores closed."""
    recovered: float | None = None
    recovery_s: float | None = None
    steps_lost: int | None = None
    step_before: int | None = None
    """The last step done before the fault (from the summary)."""
    step_after: int | None = None
    """The first step done after it (from the summary)."""


@dataclass
class Mark:
    """Something else worth a mark on the time axis (a straggler, the job's end)."""

    time: float
    label: str


@dataclass
class Round:
    """A round of the job: who trained in it (node -> node rank), from its start to the next."""

    number: int
    start: float
    end: float
    ranks: dict[str, int]
    restore: str
    topology: dict[str, dict[str, str]] = field(default_factory=dict)
    """Its members' topology labels, where their scheduler gave any."""


@dataclass
class Course:
    job: str
    run_id: str
    start: float
    """The job's start, epoch seconds; every other time counts from it."""
    end: float
    nodes: dict[str, list[list[Sample]]] = field(default_factory=dict)
    """Per node, its step samples, one list a round (a restart starts a new line)."""
    incidents: list[Incident] = field(default_factory=list)
    checkpoints: list[Sample] = field(default_factory=list)
    stragglers: list[Mark] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    job_steps: list[list[Sample]] = field(default_factory=list)
    """The job's step over time, one line between two faults: the nodes' samples, the
    checkpoints, the steps before and after each fault."""
    outcome: Mark | None = None
    first_step: float | None = None
    """When the first step was done (the summary's start-up)."""
    events: list[JobEvent] = field(default_factory=list)
    """What happened, without the step samples: the first :data:`FIRST_EVENTS` and the last
    :data:`LAST_EVENTS`."""
    events_left_out: int = 0
    """Events between those two, not kept."""
    faults: int = 0
    """Every fault, told one by one in :attr:`incidents` or not."""
    fault_kinds: dict[str, int] = field(default_factory=dict)
    """Every fault counted by its kind (and class): ``worker_failed (transient)``."""
    rounds_left_out: int = 0
    losses: list[list[LossSample]] = field(default_factory=list)
    """Rank 0's training loss over time, one line a round (a restart starts a new one); none
    when the training never reported a loss."""
    tokens: list[list[TokenSample]] = field(default_factory=list)
    """The job's tokens over time, one line a round; none when the training never reported
    tokens (``planaria.monitor.step(n, tokens=...)``)."""

    def nodes_seen(self) -> list[str]:
        """Every node that trained in a round or reported a step, in order of appearance."""
        seen = dict.fromkeys(
            n for r in self.rounds for n in sorted(r.ranks, key=r.ranks.__getitem__)
        )
        seen.update(dict.fromkeys(sorted(self.nodes)))
        return list(seen)

    def topology(self) -> dict[str, dict[str, str]]:
        """Each node's topology labels, as the last round it was in gave them (a node stays
        where it is); empty when no scheduler gave any."""
        labels: dict[str, dict[str, str]] = {}
        for r in self.rounds:
            labels.update(r.topology)
        return labels


FAULTS = (EventKind.FAULT_DETECTED, EventKind.HANG_DETECTED)


def course(events: Iterable[JobEvent | StepSample], summary: Summary | None = None) -> Course:
    """The course of the job of ``events`` (read once, in order: step samples as events or
    as :class:`~planaria.rundir.StepSample`); ``summary`` adds the steps around each fault."""
    result = Course(job="", run_id="", start=0.0, end=0.0)
    origin: float | None = None
    """The first event's time: what times count from until the job's start is known."""
    started: float | None = None
    samples: dict[str, Thinned[tuple[int, Sample]]] = {}
    losses: Thinned[tuple[int, LossSample]] = Thinned()
    tokens: Thinned[tuple[int, TokenSample]] = Thinned()
    checkpoints: Thinned[Sample] = Thinned()
    incidents: deque[Incident] = deque(maxlen=INCIDENTS)
    rounds: deque[Round] = deque(maxlen=ROUNDS)
    stragglers: deque[Mark] = deque(maxlen=STRAGGLERS)
    last_events: deque[JobEvent] = deque(maxlen=LAST_EVENTS)
    kinds: Counter[str] = Counter()
    seen_rounds = 0
    chaos: float | None = None
    for event in events:
        if origin is None:
            origin = event.time
        t = event.time - origin
        result.end = t
        if isinstance(event, StepSample):
            samples.setdefault(event.node, Thinned()).add((event.round, Sample(t, event.step)))
            if event.loss is not None and event.loss_step is not None:
                losses.add((event.round, LossSample(t, event.loss_step, event.loss)))
            if event.tokens is not None:
                tokens.add((event.round, TokenSample(t, event.step, event.tokens)))
            continue
        result.job = result.job or event.job
        kind = event.kind
        if kind is EventKind.PROGRESS:
            if event.node is not None and event.step is not None:
                round_ = int(event.data.get("round", 0))
                samples.setdefault(event.node, Thinned()).add((round_, Sample(t, event.step)))
                loss, loss_step = finite(event.data.get("loss")), event.data.get("loss_step")
                if loss is not None and type(loss_step) is int:
                    losses.add((round_, LossSample(t, loss_step, loss)))
                count = finite(event.data.get("tokens"))
                if count is not None:
                    tokens.add((round_, TokenSample(t, event.step, count)))
            continue
        if len(result.events) < FIRST_EVENTS:
            result.events.append(event)
        else:
            if len(last_events) == LAST_EVENTS:
                result.events_left_out += 1
            last_events.append(event)
        if kind is EventKind.JOB_STARTED and started is None:
            started = event.time
            result.run_id = str(event.data.get("run_id", ""))
        if kind is EventKind.CHECKPOINT_COMMITTED and event.step is not None:
            checkpoints.add(Sample(t, event.step))
        elif kind is EventKind.FAULT_DETECTED and event.data.get("fault") == "chaos":
            chaos = t
        elif kind in FAULTS and not event.data.get("secondary"):
            result.faults += 1
            incident = _incident(result.faults, event, t, chaos)
            incidents.append(incident)
            kinds[
                incident.kind + (f" ({incident.fault_class})" if incident.fault_class else "")
            ] += 1
            chaos = None
        elif kind is EventKind.STRAGGLER_DETECTED and not event.data.get("preflight"):
            ratio = float(event.data.get("ratio", 0.0))
            stragglers.append(Mark(t, f"{_where(event)} ({ratio:.1f}x)"))
        elif kind in (EventKind.JOB_FINISHED, EventKind.JOB_STOPPED):
            result.outcome = Mark(t, event.message)
        elif kind is EventKind.RENDEZVOUS_COMPLETED:
            if rounds:
                rounds[-1].end = t
            ranks = {str(n): int(r) for n, r in dict(event.data.get("ranks", {})).items()}
            restore = str(event.data.get("restore", ""))
            seen_rounds += 1
            number = int(event.data.get("round", seen_rounds))
            topology = {
                str(n): {str(k): str(v) for k, v in dict(labels).items()}
                for n, labels in dict(event.data.get("topology") or {}).items()
                if isinstance(labels, dict)
            }
            rounds.append(Round(number, t, t, ranks, restore, topology))
            _follow_up(incidents, event, t)
        else:
            _follow_up(incidents, event, t)
    result.events += last_events
    result.incidents = list(incidents)
    result.fault_kinds = dict(kinds.most_common())
    result.rounds = list(rounds)
    result.rounds_left_out = seen_rounds - len(rounds)
    result.stragglers = list(stragglers)
    result.checkpoints = checkpoints.items()
    result.nodes = {node: _lines(thinned.items()) for node, thinned in samples.items()}
    result.losses = _lines(losses.items())
    result.tokens = _lines(tokens.items())
    if result.rounds:
        result.rounds[-1].end = result.end if result.outcome is None else result.outcome.time
    if origin is not None:
        result.start = origin if started is None else started
        _shift(result, origin - result.start)
    if summary is not None:
        _steps_around(result, summary)
    result.job_steps = _job_steps(result)
    return result


S = TypeVar("S", Sample, LossSample, TokenSample)


def _lines(samples: list[tuple[int, S]]) -> list[list[S]]:
    """A node's samples (or the losses, or the tokens), one line a round."""
    lines: list[list[S]] = []
    last: int | None = None
    for round_, sample in samples:
        if not lines or round_ != last:
            lines.append([])
            last = round_
        lines[-1].append(sample)
    return lines


def _shift(result: Course, by: float) -> None:
    """Count every time of ``result`` from ``by`` seconds later than it did (the job's start
    was not its first event)."""
    if by == 0:
        return
    result.end += by
    samples = [s for lines in result.nodes.values() for line in lines for s in line]
    for sample in (*samples, *result.checkpoints):
        sample.time += by
    for loss in (s for line in result.losses for s in line):
        loss.time += by
    for count in (s for line in result.tokens for s in line):
        count.time += by
    for mark in (*result.stragglers, *([result.outcome] if result.outcome else [])):
        mark.time += by
    for r in result.rounds:
        r.start += by
        r.end += by
    for i in result.incidents:
        i.detected += by
        for name in ("injected", "restarted", "restored", "recovered"):
            value = getattr(i, name)
            if value is not None:
                setattr(i, name, value + by)


def _job_steps(result: Course) -> list[list[Sample]]:
    """One line a stretch between two faults' detections, never going back within it."""
    cuts = [i.detected for i in result.incidents]
    points = [s for lines in result.nodes.values() for line in lines for s in line]
    points += result.checkpoints
    points += [
        Sample(i.recovered, i.step_after)
        for i in result.incidents
        if i.recovered is not None and i.step_after is not None
    ]
    # A stretch after a fault starts at its recovery: a checkpoint committed meanwhile (the
    # last step, persisted at the fault) is no progress across the outage.
    starts = [i.recovered if i.recovered is not None else i.detected for i in result.incidents]
    stretches: list[list[Sample]] = [[] for _ in range(len(cuts) + 1)]
    for point in points:
        k = sum(1 for c in cuts if point.time >= c)
        if k == 0 or point.time >= starts[k - 1]:
            stretches[k].append(point)
    for k, incident in enumerate(result.incidents):
        if incident.step_before is not None:
            stretches[k].append(Sample(incident.detected, incident.step_before))
    lines = []
    for stretch in stretches:
        stretch.sort(key=lambda p: p.time)
        top = -1
        line = []
        for point in stretch:
            top = max(top, point.step)
            line.append(Sample(point.time, top))
        if line:
            lines.append(line)
    return lines


def _where(event: JobEvent) -> str:
    if event.rank is not None:
        return f"rank {event.rank} on {event.node}"
    return event.node or "-"


def _incident(number: int, event: JobEvent, t: float, chaos: float | None) -> Incident:
    fault = str(event.data.get("fault", event.kind.value))
    return Incident(
        number=number,
        kind=fault,
        where=_where(event),
        detected=t,
        message=event.message,
        injected=chaos,
        fault_class=event.data.get("fault_class"),
    )


def _follow_up(incidents: Iterable[Incident], event: JobEvent, t: float) -> None:
    """What ``event`` does for the faults before it: their restart, node, restore, recovery."""
    data = event.data
    if event.kind is EventKind.WORKERS_RESTARTED and data.get("cause") == "fault":
        for incident in incidents:
            if incident.restarted is None:
                incident.restarted, incident.round = t, int(data.get("round", 0))
    elif event.kind is EventKind.NODE_REPLACED:
        for incident in incidents:
            if incident.where == event.node and incident.replaced_by is None:
                incident.replaced_by = str(data.get("replacement"))
    elif event.kind is EventKind.RENDEZVOUS_COMPLETED:
        for incident in incidents:
            if incident.round == data.get("round") and incident.restored is None:
                incident.restored, incident.restore = t, str(data.get("restore"))
    elif event.kind is EventKind.RECOVERED:
        for incident in incidents:
            if incident.round == data.get("round") and incident.recovered is None:
                incident.recovered = t
                incident.recovery_s = data.get("recovery_s")
                incident.steps_lost = data.get("steps_lost")


def _steps_around(result: Course, summary: Summary) -> None:
    """The summary's steps before and after each fault, matched by the fault's round."""
    result.first_step = summary.startup_s
    by_round = {f.restart_round: f for f in summary.faults if f.restart_round is not None}
    for incident in result.incidents:
        fault = None if incident.round is None else by_round.get(incident.round)
        if fault is None:
            continue
        incident.action = fault.action
        incident.step_before = fault.last_step if fault.last_step >= 0 else None
        incident.step_after = fault.first_step_after
