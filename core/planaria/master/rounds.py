"""Rendezvous rounds, as the master keeps them. Pure logic with an explicit clock: no I/O.

A round closes when ``max`` nodes joined; or when every node the master still expects has
joined and at least ``min`` did; or when at least ``min`` joined and nobody came for
``join_grace``. The world is cut to a multiple of ``node_unit``; nodes beyond it stand by for the
next round. Which member gets which node rank is the configured rank placement's
(:mod:`planaria.rendezvous.api`; ``stable``: nodes that stay keep their node rank where they
can, newcomers fill the holes in join order); an answer that breaks its contract is logged and
the round placed by ``stable``.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from typing import Any

from planaria.log import get_logger
from planaria.plugin.info import one_line
from planaria.protocol import RendezvousInfo
from planaria.rendezvous.api import Candidate, RankPlacement, check_placement
from planaria.rendezvous.builtin import StablePlacement

log = get_logger("master")


@dataclass
class _Joiner:
    node_id: str
    addr: str
    port: int
    since: float
    topology: Mapping[str, str] = field(default_factory=dict)


class Rounds:
    def __init__(
        self,
        *,
        min_nodes: int,
        max_nodes: int,
        node_unit: int,
        join_grace: float,
        procs_per_node: int,
        placement: RankPlacement[Any] | None = None,
    ) -> None:
        self.placement: RankPlacement[Any] = placement or StablePlacement()
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.node_unit = node_unit
        self.join_grace = join_grace
        self.procs_per_node = procs_per_node
        self.round = 0
        """The round now forming (or, once closed, the one running)."""
        self.closed = False
        self.world: dict[str, RendezvousInfo] = {}
        self._joiners: dict[str, _Joiner] = {}
        self._ranks: dict[str, int] = {}
        self._last_join = 0.0
        self.opened_at = 0.0
        self._snapshot: tuple[tuple[int, bool, int, int], dict[str, Any]] | None = None

    def open(self, now: float) -> int:
        """Start forming the next round; the running world is dissolved."""
        self.round += 1
        self.closed = False
        self.world = {}
        self._joiners = {}
        self.opened_at = now
        self._last_join = now
        return self.round

    def join(
        self,
        node_id: str,
        addr: str,
        port: int,
        now: float,
        topology: Mapping[str, str] | None = None,
    ) -> None:
        """``topology``: where the scheduler says the node stands, for the rank placement."""
        if self.closed:
            raise RuntimeError("join() on a closed round: open() the next one first")
        if node_id not in self._joiners:
            self._last_join = now
        self._joiners[node_id] = _Joiner(node_id, addr, port, now, dict(topology or {}))

    def leave(self, node_id: str) -> None:
        """A node is gone: it no longer counts toward this round, and loses its rank."""
        self._joiners.pop(node_id, None)
        self._ranks.pop(node_id, None)

    @property
    def joined(self) -> int:
        return len(self._joiners)

    def _world_size(self) -> int:
        return min(self.joined, self.max_nodes) // self.node_unit * self.node_unit

    def ready(self, expected: Set[str] | int, now: float) -> bool:
        """Whether the round can close now. ``expected``: nodes alive or on their way, or
        their number when every joiner is one of them (a node that leaves the job leaves its
        round: :meth:`leave`); the number makes a join O(1) in the job's size."""
        size = self._world_size()
        if self.closed or size < self.min_nodes or size == 0:
            return False
        if self.joined >= self.max_nodes:
            return True
        everyone = (
            self.joined >= expected
            if isinstance(expected, int)
            else expected <= self._joiners.keys()
        )
        if everyone:
            return True
        return now - self._last_join >= self.join_grace

    def close(self, store: tuple[str, int] | None = None) -> dict[str, RendezvousInfo]:
        """Form the world: ranks, and torch.distributed's address: ``store``'s, a store that
        serves already off the workers (``rendezvous.store: master``), or else the node of
        rank 0's, whose worker of rank 0 hosts it."""
        size = self._world_size()
        joiners = {j.node_id: j for j in sorted(self._joiners.values(), key=lambda j: j.since)}
        ranks = self._place(
            [
                Candidate(j.node_id, j.since, self._ranks.get(j.node_id), j.topology)
                for j in joiners.values()
            ],
            size,
        )
        # In the order the world was always listed: survivors first, then by arrival.
        members = [
            j
            for j in joiners.values()
            if j.node_id in ranks and self._ranks.get(j.node_id, size) < size
        ]
        listed = {j.node_id for j in members}  # by id: a round of 10,000 nodes, not O(n^2)
        members += [j for j in joiners.values() if j.node_id in ranks and j.node_id not in listed]
        leader = next(j for j in members if ranks[j.node_id] == 0)
        self._ranks = dict(ranks)
        self.world = {
            j.node_id: RendezvousInfo(
                round=self.round,
                node_rank=ranks[j.node_id],
                num_nodes=size,
                rank_offset=ranks[j.node_id] * self.procs_per_node,
                world_size=size * self.procs_per_node,
                master_addr=leader.addr if store is None else store[0],
                master_port=leader.port if store is None else store[1],
                agent_store=store is not None,
            )
            for j in members
        }
        self.closed = True
        return self.world

    def _place(self, candidates: list[Candidate], size: int) -> dict[str, int]:
        """The placement's ranks; ``stable``'s where it raises or breaks the contract: a
        broken placement must not keep the job from running."""
        try:
            return check_placement(self.placement.place(candidates, size), candidates, size)
        except Exception as exc:
            log.warning(
                "rank placement failed; placing this round as 'stable' does",
                placement=self.placement.name or type(self.placement).__name__,
                round=self.round,
                error=one_line(exc),
            )
            return StablePlacement().place(candidates, size)

    def snapshot(self) -> dict[str, Any]:
        """What a restarted master needs to go on with the same round (its journal's copy).
        A round still forming is re-formed from its next joins: its joiners are not kept.
        The same object until the round changes (the journal skips what it wrote last)."""
        key = (self.round, self.closed, len(self.world), len(self._ranks))
        if self._snapshot is not None and self._snapshot[0] == key:
            return self._snapshot[1]
        snapshot = {
            "round": self.round,
            "closed": self.closed,
            "world": {n: i.model_dump(mode="json") for n, i in self.world.items()},
            "ranks": dict(self._ranks),
        }
        self._snapshot = (key, snapshot)
        return snapshot

    def restore(self, snapshot: dict[str, Any], now: float) -> None:
        self.round = int(snapshot["round"])
        self.closed = bool(snapshot["closed"])
        self.world = {
            n: RendezvousInfo.model_validate(i) for n, i in dict(snapshot["world"]).items()
        }
        self._ranks = {str(n): int(r) for n, r in dict(snapshot["ranks"]).items()}
        self._joiners = {}
        self.opened_at = self._last_join = now

    def standby(self) -> list[str]:
        """Nodes that joined but did not fit in the closed world."""
        return [n for n in self._joiners if n not in self.world]
