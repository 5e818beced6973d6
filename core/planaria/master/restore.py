"""Where a new round's workers restore from: the step every rank holds in shared memory.

Each node reports, when it joins, the complete steps its local ranks' segments hold and as which
rank of which world they were saved. Memory is usable only if every rank of the new world is
held by the node that now runs it, as the same rank of a world of the same size; the step is
then the newest one all of them hold. Anything else (a replaced node, a changed world, a rank
killed in the middle of its first save) restores from storage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from planaria.protocol import MemoryHolding, RendezvousInfo


def agree(
    world: Mapping[str, RendezvousInfo],
    memory: Mapping[str, list[MemoryHolding]],
    procs_per_node: int,
) -> tuple[int | None, str]:
    """(the step to restore from memory, or None; why)."""
    common: set[int] | None = None
    for node_id, info in sorted(world.items(), key=lambda item: item[1].node_rank):
        held = {h.local_rank: h for h in memory.get(node_id, [])}
        for local_rank in range(procs_per_node):
            rank = info.rank_offset + local_rank
            holding = held.get(local_rank)
            if holding is None:
                return None, f"rank {rank} ({node_id}) holds no step in memory"
            if (holding.rank, holding.world) != (rank, info.world_size):
                return None, (
                    f"{node_id}'s memory holds rank {holding.rank} of {holding.world}, "
                    f"it now runs rank {rank} of {info.world_size}"
                )
            steps = set(holding.steps)
            common = steps if common is None else common & steps
    if not common:
        return None, "the ranks hold no common step in memory"
    step = max(common)
    return step, f"every rank holds step {step} in memory"


@dataclass(frozen=True)
class RestorePlan:
    restore: str
    """What the workers are told: ``memory:<step>`` or ``storage``."""
    persist_step: int | None
    """The step to persist first (from memory), if storage lacks it."""
    where: str
    """``memory (step N)`` or ``storage``, as the summary says it."""
    why: str


def plan(
    world: Mapping[str, RendezvousInfo],
    memory: Mapping[str, list[MemoryHolding]],
    procs_per_node: int,
    *,
    persist_on_fault: bool,
    restarted: bool,
    committed_step: int,
) -> RestorePlan:
    """Memory when every rank of the new world holds a common step, else storage; with
    ``persist_on_fault``, a restart also persists that step if storage lacks it."""
    step, why = agree(world, memory, procs_per_node)
    persist = persist_on_fault and restarted and step is not None and step > committed_step
    where = "storage" if step is None else f"memory (step {step})"
    if not restarted and not any(memory.get(node) for node in world):
        # A fresh start: storage holds a step only when an earlier run of the job (a requeued
        # batch job) committed one, which the workers find and the master cannot know.
        where = "storage if it holds a step, else start from scratch"
        why = "the job's first round, nothing in memory"
    return RestorePlan(
        restore="storage" if step is None else f"memory:{step}",
        persist_step=step if persist else None,
        where=where,
        why=why,
    )
