"""The rendezvous kind: which member of a round gets which node rank.

The job master forms every round itself: who may join, who is excluded, which nodes are
fenced, when the round closes, how big the world is. One decision it hands to a
:class:`RankPlacement`: given the round's candidates and the world's size, which ``size`` of
them run and with which node rank each. Node rank 0's node hosts the workers' store, and
ranks decide who talks to whom in ring and tree collectives: a placement that puts nodes of
one network switch next to each other keeps most of a ring's traffic inside the switch.

The contract (checked by :func:`check_placement` and by
:class:`planaria.testing.rendezvous.RendezvousConformance`):

- The answer maps exactly ``size`` of the candidates' node ids to node ranks, and the ranks are
  ``0 .. size-1``, each once: the workers' global ranks are computed from them, and a gap or a
  repeat would make two workers one rank or leave a rank nobody holds.
- The same candidates and size give the same answer: a restarted master, or a round formed
  again, must not reshuffle the world.
- A placement that declares :attr:`RankPlacement.keeps_ranks` keeps every candidate's
  ``previous_rank`` that is below ``size``: a surviving node's workers then keep their global
  ranks, and with them the shard of data and of a sharded checkpoint they hold in memory, so
  a node lost costs a reload only where the new node stands.
- :meth:`RankPlacement.place` is pure and quick: it runs on the master's loop, once per round,
  and must neither block nor keep state between calls (a restarted master calls a new one).

The master checks every answer: one that breaks the contract, or a placement that raises, is
logged and the round is placed by ``stable`` instead, so that a broken placement never keeps a
job from running.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Generic, TypeVar

from pydantic import BaseModel

from planaria.plugin.records import PluginKind, PluginRecord

OptionsT = TypeVar("OptionsT", bound=BaseModel)


class PlacementError(ValueError):
    """A placement's answer breaks the contract (see the module docstring)."""


@dataclass(frozen=True)
class Candidate:
    """A node that joined the round, as a placement sees it."""

    node_id: str
    joined_at: float
    """When it joined this round (seconds, the master's clock): the order of arrival."""
    previous_rank: int | None = None
    """Its node rank in the round before, or None for a node new to the world."""
    topology: Mapping[str, str] = field(default_factory=dict)
    """Where the scheduler says the node stands (``{"switch": "s1", "rack": "r4"}``); empty
    when the scheduler does not say."""


class RankPlacement(ABC, Generic[OptionsT]):
    """Base class of every rank placement::

    class ByRack(RankPlacement[ByRackOptions]):
        keeps_ranks = True

        def place(self, candidates, size):
            ...
            return {"node-a": 0, "node-b": 1}
    """

    name: ClassVar[str] = ""
    keeps_ranks: ClassVar[bool] = False
    """Whether every candidate's ``previous_rank`` below ``size`` is kept (the conformance
    kit checks it when set)."""

    def __init__(self, options: OptionsT) -> None:
        self.options = options

    @abstractmethod
    def place(self, candidates: Sequence[Candidate], size: int) -> dict[str, int]:
        """``{node_id: node_rank}`` for exactly ``size`` of ``candidates`` (never more than
        there are), ranks ``0 .. size-1`` each once. ``candidates`` come in the order they
        joined; previous ranks are distinct."""


class RendezvousRecord(PluginRecord):
    """``RendezvousRecord(name="topology", factory=TopologyPlacement, options=TopologyOptions)``"""

    kind: ClassVar[PluginKind] = PluginKind.RENDEZVOUS
    factory: type[RankPlacement]  # type: ignore[type-arg]  # pydantic rejects type[X[Any]]


def check_placement(
    placed: Mapping[str, int], candidates: Sequence[Candidate], size: int
) -> dict[str, int]:
    """``placed`` as a plain dict if it keeps the contract's shape, else a
    :class:`PlacementError` saying what is wrong."""
    if not isinstance(placed, Mapping):
        raise PlacementError(f"expected a mapping of node id to node rank, got {placed!r}")
    known = {c.node_id for c in candidates}
    strangers = sorted(str(n) for n in placed if n not in known)
    if strangers:
        raise PlacementError(f"placed nodes that are not candidates: {', '.join(strangers)}")
    if len(placed) != size:
        raise PlacementError(f"placed {len(placed)} node(s), the world has {size}")
    ranks = list(placed.values())
    if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
        raise PlacementError(f"node ranks must be integers, got {ranks!r}")
    if sorted(ranks) != list(range(size)):
        raise PlacementError(f"node ranks must be 0..{size - 1} each once, got {sorted(ranks)}")
    return dict(placed)
