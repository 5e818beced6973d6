"""Where a new round's workers restore from: the step every rank holds in shared memory.

Each node reports, when it joins, the complete steps its local ranks' segments hold and as which
rank of which world they were saved, and the peers' steps it keeps as replicas
(``checkpoint.replica``). Memory is usable only if every rank of the new world is held, as the
same rank of a world of the same size, by the node that now runs it or, as a replica, by
another node of the world (the node that runs it then fetches it before its workers start); the
step is then the newest one all of them hold. Anything else (a node replaced with no replica of
it left, a changed world, a rank killed in the middle of its first save) restores from storage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from planaria.protocol import MemoryHolding, RendezvousInfo, ReplicaHolding


@dataclass(frozen=True)
class Fetch:
    """Node ``node_id`` copies ``rank`` (its ``local_rank``) at ``step`` from the replica
    ``holder`` keeps."""

    node_id: str
    local_rank: int
    rank: int
    holder: str
    step: int = -1
    """The step restored (-1 until it is agreed)."""


def agree(
    world: Mapping[str, RendezvousInfo],
    memory: Mapping[str, list[MemoryHolding]],
    procs_per_node: int,
    replicas: Mapping[str, list[ReplicaHolding]] | None = None,
) -> tuple[int | None, str]:
    """(the step to restore from memory, or None; why)."""
    step, why, _ = sources(world, memory, procs_per_node, replicas or {})
    return step, why


def sources(
    world: Mapping[str, RendezvousInfo],
    memory: Mapping[str, list[MemoryHolding]],
    procs_per_node: int,
    replicas: Mapping[str, list[ReplicaHolding]],
) -> tuple[int | None, str, list[Fetch]]:
    """(the step to restore from memory, or None; why; the replicas to fetch for it)."""
    common: set[int] | None = None
    fetches: list[Fetch] = []
    for node_id, info in sorted(world.items(), key=lambda item: item[1].node_rank):
        held = {h.local_rank: h for h in memory.get(node_id, [])}
        for local_rank in range(procs_per_node):
            rank = info.rank_offset + local_rank
            holding = held.get(local_rank)
            if holding is not None and (holding.rank, holding.world) == (rank, info.world_size):
                steps = set(holding.steps)
            else:
                holder, kept = _replica(world, replicas, node_id, rank, info.world_size)
                if holder is None:
                    if holding is None:
                        return None, f"rank {rank} ({node_id}) holds no step in memory", []
                    return (
                        None,
                        (
                            f"{node_id}'s memory holds rank {holding.rank} of {holding.world}, "
                            f"it now runs rank {rank} of {info.world_size}"
                        ),
                        [],
                    )
                fetches.append(Fetch(node_id, local_rank, rank, holder))
                steps = kept
            common = steps if common is None else common & steps
    if not common:
        return None, "the ranks hold no common step in memory", []
    step = max(common)
    fetches = [replace(f, step=step) for f in fetches]
    why = f"every rank holds step {step} in memory"
    if fetches:
        copied = ", ".join(f"rank {f.rank} from {f.holder}" for f in fetches)
        why += f" ({copied}: replicas)"
    return step, why, fetches


def _replica(
    world: Mapping[str, RendezvousInfo],
    replicas: Mapping[str, list[ReplicaHolding]],
    runner: str,
    rank: int,
    size: int,
) -> tuple[str | None, set[int]]:
    """The node of ``world`` (not ``runner``) that keeps the newest replica of ``rank`` of a
    world of ``size``, and its steps."""
    best: tuple[str | None, set[int]] = (None, set())
    for holder in sorted(world):
        if holder == runner:
            continue
        for kept in replicas.get(holder, []):
            if (kept.rank, kept.world) != (rank, size) or not kept.steps:
                continue
            if best[0] is None or max(kept.steps) > max(best[1]):
                best = (holder, set(kept.steps))
    return best


@dataclass(frozen=True)
class RestorePlan:
    restore: str
    """What the workers are told: ``memory:<step>`` or ``storage``."""
    persist_step: int | None
    """The step to persist first (from memory), if storage lacks it."""
    where: str
    """``memory (step N)`` or ``storage``, as the summary says it."""
    why: str
    fetches: tuple[Fetch, ...] = ()
    """Replicas to copy before the workers start, for a memory restore."""


def plan(
    world: Mapping[str, RendezvousInfo],
    memory: Mapping[str, list[MemoryHolding]],
    procs_per_node: int,
    *,
    persist_on_fault: bool,
    restarted: bool,
    committed_step: int,
    replicas: Mapping[str, list[ReplicaHolding]] | None = None,
) -> RestorePlan:
    """Memory when every rank of the new world holds a common step (in its memory or in a
    peer's replica), else storage; with ``persist_on_fault``, a restart also persists that
    step if storage lacks it."""
    step, why, fetches = sources(world, memory, procs_per_node, replicas or {})
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
        fetches=tuple(fetches),
    )
