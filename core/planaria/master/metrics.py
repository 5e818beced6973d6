"""The master's metrics in Prometheus' text format, served at ``GET /metrics``.

Two sources, so that neither a scrape nor a heartbeat costs more than it must. What the job's
state says now (its state, its nodes by phase, the round, the step, the goodput, each node's
step time and straggler flag) is read when Prometheus scrapes, by a collector: one pass over
the nodes, nothing kept between scrapes and nothing done per heartbeat. What happened
(restarts, faults, recoveries, checkpoints, failed health checks ...) is counted from the job's
events as its timeline emits them: a few increments per event, and events are rare.

Each master has a registry of its own, never prometheus_client's global one: several masters
may live in one process (the tests do), and one job's metrics must not show another's.
Counters count from this master's start: a master resumed with ``planaria run --resume``
starts them from zero again, which Prometheus' ``rate()`` and ``increase()`` read as a reset.
``planaria_tokens_total`` is the job's count: a resumed master counts on from the timeline.
``docs/metrics.md`` lists every metric.

Why one module: both sources feed one registry, one scrape and the one list of metrics
(``docs/metrics.md``); split, a metric's name and what it counts would live apart.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from pydantic import RootModel

from planaria import events
from planaria.events import EventKind, JobEvent, Payload
from planaria.log import get_logger
from planaria.master.job import Master
from planaria.master.state import JobState, NodePhase

log = get_logger("master.metrics")

MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Prometheus' text exposition format, the one every Prometheus version scrapes."""

FAULT_KINDS = ("worker_failed", "node_lost", "hang", "unhealthy", "straggler", "preflight")
"""What a fault can be (:attr:`planaria.master.summary.Fault.kind`); the restart causes
are these and ``scale_up``."""
UNCLASSIFIED = "unclassified"
"""The ``class`` of a fault the diagnosis does not classify (a lost node)."""

RECOVERY_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
PERSIST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Exposition(RootModel[str]):
    """The job's metrics in Prometheus' text exposition format, version 0.0.4."""


P = TypeVar("P", bound=Payload)


class JobMetrics:
    """One master's metrics: its registry, the counters its events move, and the collector
    that reads its state at each scrape."""

    def __init__(self, master: Master) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.events = Counter("planaria_events", "Job events, by kind", ["kind"], registry=r)
        self.restarts = Counter(
            "planaria_restarts",
            "Restarts of every node's workers into a new round, by cause: the fault's kind, "
            "or scale_up",
            ["cause"],
            registry=r,
        )
        self.faults = Counter(
            "planaria_faults",
            "Faults found, by kind and class (node, transient, user, unclassified)",
            ["fault", "class"],
            registry=r,
        )
        self.injected = Counter(
            "planaria_faults_injected",
            "Chaos rules announced as they fired, by kind",
            ["kind"],
            registry=r,
        )
        self.recovery = Histogram(
            "planaria_recovery_seconds",
            "From a fault to the first step the restarted job completed",
            registry=r,
            buckets=RECOVERY_BUCKETS,
        )
        self.steps_lost = Counter(
            "planaria_steps_lost", "Steps done before a fault and done again after it", registry=r
        )
        self.stragglers = Counter(
            "planaria_stragglers", "Ranks flagged as stragglers, by measure", ["metric"], registry=r
        )
        self.health = Counter(
            "planaria_health_checks",
            "Failed health checks that kept a node out of a round, by check and verdict",
            ["check", "verdict"],
            registry=r,
        )
        self.preflight = Counter(
            "planaria_preflight_verdicts",
            "Verdicts of the pre-flight node check, by verdict",
            ["verdict"],
            registry=r,
        )
        self.replacements = Counter(
            "planaria_node_replacements",
            "Replacements asked of the scheduler, by outcome",
            ["outcome"],
            registry=r,
        )
        self.removed = Counter(
            "planaria_nodes_removed", "Nodes stopped with none in their place", registry=r
        )
        self.excluded = Counter("planaria_hosts_excluded", "Hosts excluded", registry=r)
        self.fenced = Counter(
            "planaria_nodes_fenced", "Lost nodes that came back and were fenced out", registry=r
        )
        self.refused = Counter(
            "planaria_registrations_refused", "Agent registrations refused", registry=r
        )
        self.committed = Counter(
            "planaria_checkpoints_committed", "Checkpoints committed to storage", registry=r
        )
        self.committed_bytes = Counter(
            "planaria_checkpoint_committed_bytes",
            "Bytes of the checkpoints committed to storage",
            registry=r,
        )
        self.last_bytes = Gauge(
            "planaria_checkpoint_last_committed_bytes",
            "Size of the last checkpoint committed",
            registry=r,
        )
        self.persist = Histogram(
            "planaria_checkpoint_persist_seconds",
            "From rank 0's shard of a step in storage to the step committed",
            registry=r,
            buckets=PERSIST_BUCKETS,
        )
        self.persist_failures = Counter(
            "planaria_checkpoint_persist_failures", "Shards that failed to persist", registry=r
        )
        self.skipped = Counter(
            "planaria_checkpoints_skipped",
            "Committed steps a restore skipped as corrupt",
            registry=r,
        )
        self.persister_restarts = Counter(
            "planaria_persister_restarts", "Checkpoint persisters that died and were restarted",
            registry=r,
        )  # fmt: skip
        self.stalls = Counter("planaria_master_stalls", "Stalls of the master itself", registry=r)
        self.stalled = Counter(
            "planaria_master_stalled_seconds", "Time the master itself stalled", registry=r
        )
        for kind in EventKind:  # every series from the start: increase() sees the first one
            self.events.labels(kind.value)
        for cause in (*FAULT_KINDS, "scale_up"):
            self.restarts.labels(cause)
        for outcome in ("replaced", "failed"):
            self.replacements.labels(outcome)
        self._counts: dict[type[Payload], Callable[[Any, JobEvent], None]] = {}
        self._on(events.WorkersRestarted, self._restarted)
        self._on(events.FaultDetected, self._fault)
        self._on(events.HangDetected, self._hang)
        self._on(events.StragglerDetected, self._straggler)
        self._on(events.HealthChecked, self._health)
        self._on(events.Recovered, self._recovered)
        self._on(events.PreflightCompleted, self._preflight)
        self._on(events.CheckpointCommitted, self._committed)
        self._on(events.MasterStalled, self._stalled)
        self._on(events.NodeReplaced, lambda p, e: self.replacements.labels("replaced").inc())
        self._on(
            events.NodeReplacementFailed, lambda p, e: self.replacements.labels("failed").inc()
        )
        self._on(events.NodeRemoved, lambda p, e: self.removed.inc())
        self._on(events.NodeExcluded, lambda p, e: self.excluded.inc())
        self._on(events.NodeFenced, lambda p, e: self.fenced.inc())
        self._on(events.RegistrationRefused, lambda p, e: self.refused.inc())
        self._on(events.CheckpointFailed, lambda p, e: self.persist_failures.inc())
        self._on(events.CheckpointSkipped, lambda p, e: self.skipped.inc())
        self._on(events.PersisterRestarted, lambda p, e: self.persister_restarts.inc())
        self.state = StateNow(master)
        r.register(self.state)
        for event in master.timeline.events:  # what this master saw before: its resume ...
            self.observe(event)
        master.timeline.watch(self.observe)

    def _on(self, kind: type[P], count: Callable[[P, JobEvent], None]) -> None:
        self._counts[kind] = count

    def exposition(self) -> Exposition:
        """Every metric, as a scrape gets it."""
        text = generate_latest(_Uncreated(self.registry)).decode()
        return Exposition(text + self.state.by_node())

    # -- what happened ----------------------------------------------------------------------

    def observe(self, event: JobEvent) -> None:
        """Count ``event`` (the timeline calls this for each one). A bug here must not stop
        the job: it is logged, and only the metrics miss the event."""
        try:
            self.events.labels(event.kind.value).inc()
            payload = event.payload
            count = self._counts.get(type(payload))
            if count is not None:
                count(payload, event)
        except Exception:
            log.exception("an event was not counted in the metrics", kind=event.kind.value)

    def _restarted(self, p: events.WorkersRestarted, _: JobEvent) -> None:
        cause = "scale_up" if p.cause == "scale_up" else p.fault or "fault"
        self.restarts.labels(cause).inc()

    def _fault(self, p: events.FaultDetected, _: JobEvent) -> None:
        if p.fault == "chaos":
            self.injected.labels(str((p.rule or {}).get("kind", "unknown"))).inc()
        elif not p.secondary:  # a peer's failure in the same round is the same fault
            kind = UNCLASSIFIED if p.fault_class is None else p.fault_class.value
            self.faults.labels(p.fault, kind).inc()

    def _hang(self, p: events.HangDetected, _: JobEvent) -> None:
        if not p.secondary:
            self.faults.labels("hang", p.fault_class).inc()

    def _straggler(self, p: events.StragglerDetected, _: JobEvent) -> None:
        if p.preflight:  # the pre-flight check's verdicts count it
            self.faults.labels("preflight", "node").inc()
            return
        self.stragglers.labels(p.metric).inc()
        self.faults.labels("straggler", "node").inc()

    def _health(self, p: events.HealthChecked, _: JobEvent) -> None:
        for failure in p.failures:
            self.health.labels(failure.check, failure.status).inc()
        if not p.healthy:
            self.faults.labels("unhealthy", "node").inc()

    def _recovered(self, p: events.Recovered, _: JobEvent) -> None:
        self.recovery.observe(p.recovery_s)
        if p.steps_lost:
            self.steps_lost.inc(p.steps_lost)

    def _preflight(self, p: events.PreflightCompleted, _: JobEvent) -> None:
        for verdict in p.verdicts:
            self.preflight.labels(verdict.verdict).inc()

    def _committed(self, p: events.CheckpointCommitted, _: JobEvent) -> None:
        self.committed.inc()
        if p.bytes is not None:
            self.committed_bytes.inc(p.bytes)
            self.last_bytes.set(p.bytes)
        if p.seconds is not None:
            self.persist.observe(p.seconds)

    def _stalled(self, p: events.MasterStalled, _: JobEvent) -> None:
        self.stalls.inc()
        self.stalled.inc(p.seconds)


class StateNow:
    """What the master's state says at the time of a scrape: one pass over its nodes."""

    def __init__(self, master: Master) -> None:
        self.master = master

    def collect(self) -> Iterator[Metric]:
        m = self.master
        info = GaugeMetricFamily(
            "planaria_job_info", "The job, and this run of it (always 1)", labels=["job", "run_id"]
        )
        info.add_metric([m.spec.job, m.spec.run_id], 1)
        yield info
        state = GaugeMetricFamily(
            "planaria_job_state", "1 for the job's state, 0 for the others", labels=["state"]
        )
        for each in JobState:
            state.add_metric([each.value], 1 if m.state is each else 0)
        yield state
        yield _gauge("planaria_round", "The rendezvous round forming, or running", m.round)
        yield _gauge("planaria_world_nodes", "Nodes in the running world", len(m.world))
        yield _gauge("planaria_channels_open", "Agents' channels open now", m.channel.open)
        push = GaugeMetricFamily(
            "planaria_channel_last_push_seconds",
            "The last push burst, by what it answered",
            labels=["op"],
        )
        for op, seconds in m.channel.last_push_s.items():
            push.add_metric([op], seconds)
        yield push
        yield CounterMetricFamily("planaria_channel_notices_refused",
                                  "Agents' notices refused (a bad heartbeat, an unknown node)",
                                  value=m.channel.notices_refused)  # fmt: skip
        yield _gauge("planaria_max_restarts", "The restart budget (job.max_restarts)",
                     m.spec.max_restarts)  # fmt: skip
        yield from self._nodes()
        summary = m.summary()
        yield _gauge("planaria_wall_seconds", "From the job's start to now, or to its end",
                     summary.wall_s)  # fmt: skip
        yield _gauge("planaria_downtime_seconds",
                     "Sum of the recovery times of the faults recovered from",
                     summary.downtime_s)  # fmt: skip
        if summary.startup_s is not None:
            yield _gauge("planaria_startup_seconds", "From the job's start to its first step",
                         summary.startup_s)  # fmt: skip
        if summary.goodput is not None:
            yield _gauge(
                "planaria_goodput_ratio",
                "(wall - startup - downtime) / wall, as the run's summary says",
                summary.goodput,
            )
        if m.loss is not None:  # only once a worker reported one: no made-up zero before
            yield _gauge("planaria_loss", "Rank 0's last training loss, as its worker reported it",
                         m.loss[2])  # fmt: skip
        if m.tokens.total is not None:  # likewise; rate() of it is the job's tokens/s
            yield CounterMetricFamily("planaria_tokens", "Tokens the job processed, as rank 0's "
                                      "worker reported them", value=m.tokens.total)  # fmt: skip
        committed = m.checkpoints.committed_step
        yield _gauge("planaria_checkpoint_last_committed_step",
                     "The newest step committed to storage (-1: none)", committed)  # fmt: skip

    def _nodes(self) -> Iterator[Metric]:
        m = self.master
        world = m.world
        phases: Tally[NodePhase] = Tally()
        step = -1
        for node in m.nodes.values():
            phases[node.phase] += 1
            if node.node_id in world:
                step = max(step, node.step)
        yield _gauge("planaria_step", "The newest step a node of the running world completed "
                     "(-1: none yet)", step)  # fmt: skip
        nodes = GaugeMetricFamily("planaria_nodes", "The job's nodes, by state", labels=["state"])
        for phase in NodePhase:
            nodes.add_metric([phase.value], phases[phase])
        yield nodes

    def by_node(self) -> str:
        """The per-node families, as text. Written here rather than by prometheus_client,
        whose per-sample work makes a scrape of 10,000 nodes several times slower (see
        ``benchmarks/metrics_scrape.py``); only the node's id needs escaping."""
        m = self.master
        wall: dict[str, float] = {}
        busy: dict[str, float] = {}
        for times in m.diagnosis.step_times().values():  # a node is as slow as its slowest rank
            if times.wall_s is not None:
                wall[times.node] = max(wall.get(times.node, 0.0), times.wall_s)
            if times.busy_s is not None:
                busy[times.node] = max(busy.get(times.node, 0.0), times.busy_s)
        flagged = {node for node, _ in m.diagnosis.detector.flagged}
        straggler = {
            n.node_id: 1.0 if n.node_id in flagged else 0.0
            for n in m.nodes.values()
            if not n.phase.gone
        }
        return "".join(
            (
                _by_node(
                    "planaria_node_step_seconds",
                    "Median wall-clock seconds per step of the node's slowest rank, this round",
                    wall,
                ),
                _by_node(
                    "planaria_node_step_busy_seconds",
                    "Median busy (CPU) seconds per step of the node's slowest rank, this round",
                    busy,
                ),
                _by_node(
                    "planaria_node_straggler",
                    "1 if a rank of the node was flagged as a straggler, else 0 (nodes in the job)",
                    straggler,
                ),
            )
        )


class _Uncreated:
    """A registry's metrics without the ``_created`` series prometheus_client adds to each
    counter and histogram: the text format has no use for them, and they would double the
    scrape (turning them off is process-wide; other registries may want them)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _by_node(name: str, documentation: str, values: dict[str, float]) -> str:
    """A gauge family labelled by node, in the text format."""
    lines = [f"# HELP {name} {documentation}\n# TYPE {name} gauge\n"]
    lines += [f'{name}{{node="{_escaped(node)}"}} {value!r}\n' for node, value in values.items()]
    return "".join(lines)


def _escaped(value: str) -> str:
    """A label value as the text format quotes it."""
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value
