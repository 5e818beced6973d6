"""The conformance suite of rank placements (:class:`~planaria.rendezvous.api.RankPlacement`,
registered through ``planaria_rendezvous``).

Every placement must keep the contract of :mod:`planaria.rendezvous.api`: exactly ``size`` of
the candidates, node ranks ``0 .. size-1`` each once (else two workers share a global rank or a
rank is held by nobody), the same answer for the same round (else a restarted master reshuffles
the world), and, for a placement that declares ``keeps_ranks``, every survivor's rank that still
fits (else a survivor loses the state it holds in memory). The suite asks these of many rounds:
first rounds, rounds after a loss, shrinking and growing worlds, nodes with and without
topology labels. The master falls back to ``stable`` when a placement breaks them; a placement
that passes here is never overruled.

Example::

    class TestByRack(RendezvousConformance):
        placement_name = "byrack"
        placement_options = {"label": "rack"}
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginKind
from planaria.rendezvous.api import Candidate, RankPlacement, RendezvousRecord, check_placement

Round = tuple[list[Candidate], int]


def rounds(seed: int = 7, count: int = 60) -> Iterator[Round]:
    """Rounds a master may ask to place (candidates in join order, and the world's size):
    a fixed set, the same on every run, so that a failure can be reproduced."""
    rng = random.Random(seed)
    labels = ["s1", "s2", "s3"]
    for index in range(count):
        joined = rng.randint(1, 12)
        size = rng.randint(1, joined)
        previous = rng.sample(range(joined + 2), rng.randint(0, joined)) if index % 3 else []
        ids = rng.sample(range(1000), joined)
        candidates = []
        for position, number in enumerate(ids):
            topology: dict[str, str] = {}
            if rng.random() < 0.85:
                topology["switch"] = rng.choice(labels)
            if rng.random() < 0.5:
                topology["rack"] = f"r{rng.randint(0, 3)}"
            rank = previous[position] if position < len(previous) else None
            candidates.append(Candidate(f"node-{number}", 100.0 + position, rank, topology))
        yield candidates, size


class RendezvousConformance:
    """Tests every rank placement must pass; see the module docstring."""

    placement_name: ClassVar[str | None] = None
    """The name the installed plugin registers (``rendezvous.backend``)."""
    placement_options: ClassVar[dict[str, Any]] = {}
    """Its options, as a job file would give them."""

    @pytest.fixture
    def record(self) -> RendezvousRecord:
        if self.placement_name is None:
            pytest.fail(
                "a RendezvousConformance subclass must set placement_name (the name its plugin "
                "registers) or define a `placement` fixture"
            )
        found = PluginManager.from_entry_points().resolve(
            PluginKind.RENDEZVOUS, self.placement_name
        )
        assert isinstance(found, RendezvousRecord)
        return found

    @pytest.fixture
    def placement(self, record: RendezvousRecord) -> RankPlacement[Any]:
        built: RankPlacement[Any] = record.factory(
            record.options.model_validate(self.placement_options)
        )
        return built

    def test_every_round_gets_size_members_ranked_0_to_size(
        self, placement: RankPlacement[Any]
    ) -> None:
        assert isinstance(placement, RankPlacement), f"{placement!r} is not a RankPlacement"
        for candidates, size in rounds():
            placed = placement.place(list(candidates), size)
            check_placement(placed, candidates, size)

    def test_a_world_of_one_and_a_world_of_everyone(self, placement: RankPlacement[Any]) -> None:
        candidates = [
            Candidate(f"node-{i}", float(i), None, {"switch": f"s{i % 2}"}) for i in range(6)
        ]
        assert list(placement.place(candidates[:1], 1).values()) == [0]
        placed = check_placement(placement.place(candidates, 6), candidates, 6)
        assert set(placed) == {c.node_id for c in candidates}

    def test_the_same_round_is_placed_the_same(self, placement: RankPlacement[Any]) -> None:
        # A restarted master builds a new placement: it must answer as the old one did.
        again: RankPlacement[Any] = type(placement)(placement.options)
        for candidates, size in rounds(seed=11, count=30):
            first = placement.place(list(candidates), size)
            assert placement.place(list(candidates), size) == first, (candidates, size)
            assert again.place(list(candidates), size) == first, (candidates, size)

    def test_survivors_keep_their_ranks(self, placement: RankPlacement[Any]) -> None:
        if not placement.keeps_ranks:
            pytest.skip("the placement does not declare keeps_ranks")
        for candidates, size in rounds(seed=13):
            placed = placement.place(list(candidates), size)
            lost = {
                c.node_id: (c.previous_rank, placed.get(c.node_id))
                for c in candidates
                if c.previous_rank is not None
                and c.previous_rank < size
                and placed.get(c.node_id) != c.previous_rank
            }
            assert not lost, f"survivors moved (node: (before, now)) in a world of {size}: {lost}"

    def test_a_lost_nodes_rank_goes_to_a_newcomer(self, placement: RankPlacement[Any]) -> None:
        if not placement.keeps_ranks:
            pytest.skip("the placement does not declare keeps_ranks")
        before = [Candidate(f"node-{i}", float(i), i, {"switch": f"s{i // 2}"}) for i in range(4)]
        newcomer = Candidate("node-9", 9.0, None, {"switch": "s0"})
        candidates = [before[0], *before[2:], newcomer]  # node-1 (rank 1) was lost
        placed = placement.place(candidates, 4)
        assert placed == {"node-0": 0, "node-2": 2, "node-3": 3, "node-9": 1}

    def test_the_candidates_are_left_as_they_came(self, placement: RankPlacement[Any]) -> None:
        for candidates, size in rounds(seed=17, count=10):
            given = list(candidates)
            placement.place(given, size)
            assert given == candidates, "place() changed the list of candidates it was given"
