"""The core's rank placements: ``stable`` (the default) and ``topology``.

Both keep a surviving node's rank where it still fits: its workers keep their global ranks,
and with them what they hold in memory. They differ in where a newcomer goes.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from planaria.plugin import hookimpl
from planaria.plugin.records import NoOptions
from planaria.rendezvous.api import Candidate, RankPlacement, RendezvousRecord


def _survivors(candidates: Sequence[Candidate], size: int) -> dict[str, int]:
    return {
        c.node_id: c.previous_rank
        for c in candidates
        if c.previous_rank is not None and c.previous_rank < size
    }


def _members(candidates: Sequence[Candidate], size: int, kept: dict[str, int]) -> list[Candidate]:
    """The round's world: the survivors, then newcomers in the order they joined. Who runs is
    fair to arrival whatever the placement; only where each runs is the placement's."""
    arrived = sorted(candidates, key=lambda c: (c.joined_at, c.node_id))
    members = [c for c in arrived if c.node_id in kept]
    members += [c for c in arrived if c.node_id not in kept][: size - len(members)]
    return members


def _nearest(free: list[int], held: list[int]) -> int:
    """The free rank (``free`` sorted) nearest to one of ``held``; the lower on a tie."""
    best: tuple[int, int] | None = None
    for rank in held:
        at = bisect.bisect_left(free, rank)
        for index in (at - 1, at):
            if 0 <= index < len(free):
                choice = (abs(free[index] - rank), free[index])
                best = choice if best is None or choice < best else best
    assert best is not None, "no free rank for a newcomer"
    return best[1]


class StablePlacement(RankPlacement[NoOptions]):
    """Survivors keep their ranks; newcomers take the free ranks, lowest first, in the order
    they joined. The first round is ranked by arrival."""

    name = "stable"
    keeps_ranks = True

    def __init__(self, options: NoOptions | None = None) -> None:
        super().__init__(options or NoOptions())

    def place(self, candidates: Sequence[Candidate], size: int) -> dict[str, int]:
        kept = _survivors(candidates, size)
        members = _members(candidates, size, kept)
        free = iter(sorted(set(range(size)) - set(kept.values())))
        return {c.node_id: kept[c.node_id] if c.node_id in kept else next(free) for c in members}


class TopologyOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    label: str = Field(
        default="switch",
        min_length=1,
        description="the topology label whose equal values get contiguous node ranks",
    )


class TopologyPlacement(RankPlacement[TopologyOptions]):
    """Nodes with the same value of the topology label (``switch``) get contiguous ranks, so
    that a ring collective crosses between groups as few times as there are groups.

    Survivors keep their ranks: moving one would cost it its in-memory state, which is worth
    more than a tidier ring. A newcomer takes the free rank nearest to a rank of its group (a
    node of switch s1 replacing a lost node of s1 takes the lost node's rank); one whose group
    holds no rank yet takes the lowest free rank. The first round is sorted by (label value,
    join time). A node without the label is a group of its own, placed after the others.
    """

    name = "topology"
    keeps_ranks = True

    def _group(self, candidate: Candidate) -> tuple[int, str]:
        value = candidate.topology.get(self.options.label)
        return (0, value) if value is not None else (1, candidate.node_id)

    def _order(self, candidate: Candidate) -> tuple[bool, str, float, str]:
        value = candidate.topology.get(self.options.label)
        return (value is None, value or "", candidate.joined_at, candidate.node_id)

    def place(self, candidates: Sequence[Candidate], size: int) -> dict[str, int]:
        kept = _survivors(candidates, size)
        members = _members(candidates, size, kept)
        # By group, then by arrival; nodes without the label (each a group) last, by arrival.
        newcomers = sorted(
            (c for c in members if c.node_id not in kept),
            key=self._order,
        )
        placed = dict(kept)
        free = sorted(set(range(size)) - set(kept.values()))
        groups = {c.node_id: self._group(c) for c in members}
        held: dict[tuple[int, str], list[int]] = {}
        for node_id, rank in kept.items():
            held.setdefault(groups[node_id], []).append(rank)
        # Newcomers whose group holds ranks first: each placement may pull the next closer.
        later = []
        for candidate in newcomers:
            group = groups[candidate.node_id]
            if group not in held:
                later.append(candidate)
                continue
            rank = _nearest(free, held[group])
            free.remove(rank)
            placed[candidate.node_id] = rank
            held[group].append(rank)
        for candidate in later:  # in (group, join time) order: a new group stays together
            placed[candidate.node_id] = free.pop(0)
        return placed


@hookimpl
def planaria_rendezvous() -> Iterable[RendezvousRecord]:
    yield RendezvousRecord(
        name="stable",
        factory=StablePlacement,
        summary="survivors keep their node rank; newcomers fill free ranks in join order",
    )
    yield RendezvousRecord(
        name="topology",
        factory=TopologyPlacement,
        options=TopologyOptions,
        summary="nodes of one switch (a topology label) get contiguous node ranks",
    )
