"""The pre-flight node check's judgement. Pure logic, no I/O: the master's session
(:mod:`planaria.master.preflight`) feeds it what the nodes report.

Round 1 puts every node in a small group (pairs, and one group of three when the count is odd)
and compares each node's measures with the median of the other nodes' (so that a slow node does
not raise its own yardstick, which matters when few nodes completed). A node whose group failed
or timed out, or whose measure exceeds ``factor`` times that median, is a suspect: a collective
that fails cannot say which of its members broke it, and one slow member slows its partner's
collective too.

Round 2 puts each suspect in a group with a node that passed round 1 (a known-good node), or
alone when no good node is left over, and compares it with the known-good nodes' measures. Its
verdict:

- ``faulty``: it failed or timed out again, next to a good node;
- ``straggler``: it completed but is slower than ``factor`` times the baseline again;
- ``cleared``: it was fine next to a good node: its round-1 trouble was its partner's.

A newcomer (a replacement, or a node that came after round 1 started) is checked once, in a
group with a known-good node, and judged the same way.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

Status = Literal["ok", "failed", "timeout", "lost"]
VerdictKind = Literal["faulty", "straggler", "cleared"]
NEWCOMER = "newcomer"
STOPPED = "stopped: a member of its group failed"
"""The error of a node whose benchmark was stopped because a peer of its group failed."""


@dataclass(frozen=True)
class Outcome:
    """One node's run of the benchmark in one group."""

    node: str
    status: Status
    measures: Mapping[str, float] = field(default_factory=dict)
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def describe(self) -> str:
        if self.ok:
            return ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in sorted(self.measures.items()))
        return f"{self.status}: {self.error}" if self.error else self.status


@dataclass(frozen=True)
class Slowness:
    """A measure above ``factor`` x ``baseline``: the median of the other nodes compared (round
    1: every other node that completed; round 2: the known-good nodes)."""

    measure: str
    seconds: float
    baseline: float

    @property
    def ratio(self) -> float:
        return self.seconds / self.baseline if self.baseline > 0 else float("inf")

    def describe(self) -> str:
        return (
            f"{self.measure} {self.seconds * 1000:.1f} ms, {self.ratio:.1f}x the other nodes' "
            f"median ({self.baseline * 1000:.1f} ms)"
        )


@dataclass(frozen=True)
class Verdict:
    node: str
    kind: VerdictKind
    detail: str
    first: str
    """Why the node was a suspect in round 1 (or ``newcomer``)."""
    slow: Slowness | None = None


@dataclass
class PreflightReport:
    """What the summary shows: how many nodes, in how many rounds, and the verdicts."""

    nodes: int = 0
    rounds: int = 0
    baseline: dict[str, float] = field(default_factory=dict)
    """Per measure, the good nodes' median."""
    slowest: dict[str, tuple[str, float]] = field(default_factory=dict)
    """Per measure, the slowest good node and its time."""
    verdicts: list[Verdict] = field(default_factory=list)
    hosts: dict[str, str] = field(default_factory=dict)
    actions: dict[str, str] = field(default_factory=dict)


def groups_of(nodes: Sequence[str]) -> list[list[str]]:
    """Pairs in the given order; with an odd count the last group has three (one node: alone)."""
    if len(nodes) <= 1:
        return [list(nodes)] if nodes else []
    groups = [list(nodes[i : i + 2]) for i in range(0, len(nodes) - 1, 2)]
    if len(nodes) % 2:
        groups[-1].append(nodes[-1])
    return groups


def baseline(outcomes: Iterable[Outcome]) -> dict[str, float]:
    """Per measure, the median over the nodes that completed."""
    values: dict[str, list[float]] = {}
    for outcome in outcomes:
        if outcome.ok:
            for name, value in outcome.measures.items():
                values.setdefault(name, []).append(value)
    return {name: statistics.median(v) for name, v in sorted(values.items())}


def slowest_per_measure(outcomes: Iterable[Outcome]) -> dict[str, tuple[str, float]]:
    """Per measure, the node that took longest among those that completed, and its time."""
    found: dict[str, tuple[str, float]] = {}
    for outcome in outcomes:
        if outcome.ok:
            for name, value in outcome.measures.items():
                if name not in found or value > found[name][1]:
                    found[name] = (outcome.node, value)
    return dict(sorted(found.items()))


def slowest(outcome: Outcome, pool: Iterable[Outcome], factor: float) -> Slowness | None:
    """The measure of ``outcome`` most above ``factor`` x the median of the other nodes of
    ``pool`` (those that completed), if any is."""
    others = baseline(o for o in pool if o.node != outcome.node)
    found = [
        Slowness(name, value, others[name])
        for name, value in outcome.measures.items()
        if name in others and value > factor * others[name]
    ]
    return max(found, key=lambda s: s.ratio, default=None)


def suspects_of(
    groups: Sequence[Sequence[Outcome]], factor: float
) -> tuple[list[str], dict[str, str]]:
    """Round 1: the nodes that passed (in order), and each suspect with why."""
    good: list[str] = []
    suspects: dict[str, str] = {}
    pool = [o for group in groups for o in group]
    for group in groups:
        broken = [o for o in group if not o.ok]
        # Name the members that failed by themselves, not those stopped because of them.
        broken = [o for o in broken if not o.error.startswith(STOPPED)] or broken
        for outcome in group:
            slow = slowest(outcome, pool, factor) if outcome.ok else None
            if broken:
                culprits = ", ".join(f"{o.node} {o.describe()}" for o in broken)
                suspects[outcome.node] = f"its group failed ({culprits})"
            elif slow is not None:
                suspects[outcome.node] = f"slow: {slow.describe()}"
            else:
                good.append(outcome.node)
    return good, suspects


def regroup(suspects: Sequence[str], good: Sequence[str]) -> list[list[str]]:
    """Round 2: each suspect with a distinct good node (the good one leads), or alone."""
    partners = iter(good)
    groups = []
    for suspect in suspects:
        partner = next(partners, None)
        groups.append([suspect] if partner is None else [partner, suspect])
    return groups


def judge(
    outcome: Outcome, good: Iterable[Outcome], factor: float, first: str, partner: str | None
) -> Verdict:
    """A suspect's (or newcomer's) verdict from its run next to ``partner``, a good node;
    ``good``: what the known-good nodes measured."""
    beside = f"next to good node {partner}" if partner else "alone (no good node was free)"
    again = "" if first == NEWCOMER else " again"
    if not outcome.ok:
        return Verdict(outcome.node, "faulty", f"{outcome.describe()}{again}, {beside}", first)
    slow = slowest(outcome, good, factor)
    if slow is not None:
        detail = f"slow{again}, {beside}: {slow.describe()}"
        return Verdict(outcome.node, "straggler", detail, first, slow)
    return Verdict(outcome.node, "cleared", f"fine {beside}: {outcome.describe()}", first)
