"""Where a new round's workers restore from, and what the timeline says of it: a fresh start
is not called a restore from storage."""

from __future__ import annotations

from planaria.master.restore import Fetch, RestorePlan, plan
from planaria.protocol import MemoryHolding, RendezvousInfo, ReplicaHolding


def _world(nodes: int) -> dict[str, RendezvousInfo]:
    return {
        f"node-{i}": RendezvousInfo(
            round=1,
            node_rank=i,
            num_nodes=nodes,
            rank_offset=i,
            world_size=nodes,
            master_addr="127.0.0.1",
            master_port=29500,
        )
        for i in range(nodes)
    }


def _plan(memory: dict[str, list[MemoryHolding]], *, restarted: bool) -> RestorePlan:
    return plan(_world(2), memory, 1, persist_on_fault=True, restarted=restarted, committed_step=-1)


def test_a_fresh_start_says_it_starts_from_scratch_unless_storage_holds_a_step():
    fresh = _plan({}, restarted=False)
    assert fresh.restore == "storage"  # the workers still look: a requeued job resumes so
    assert fresh.where == "storage if it holds a step, else start from scratch"
    assert fresh.why == "the job's first round, nothing in memory"


def test_a_restart_without_memory_restores_from_storage_and_says_why():
    after = _plan({}, restarted=True)
    assert (after.restore, after.where) == ("storage", "storage")
    assert after.why == "rank 0 (node-0) holds no step in memory"


def test_a_node_that_lost_its_memory_is_no_fresh_start():
    held = [MemoryHolding(local_rank=0, rank=0, world=2, steps=[7])]
    grown = _plan({"node-0": held}, restarted=False)  # a re-formed world, node-1 new
    assert (grown.restore, grown.where) == ("storage", "storage")
    assert grown.why == "rank 1 (node-1) holds no step in memory"
    both = _plan(
        {"node-0": held, "node-1": [held[0].model_copy(update={"rank": 1})]}, restarted=True
    )
    assert (both.restore, both.where) == ("memory:7", "memory (step 7)")


def _held(rank: int, world: int, *steps: int) -> MemoryHolding:
    return MemoryHolding(local_rank=0, rank=rank, world=world, steps=list(steps))


def _kept(rank: int, world: int, *steps: int) -> ReplicaHolding:
    return ReplicaHolding(rank=rank, world=world, steps=list(steps), source="lost")


def test_a_replaced_nodes_rank_restores_from_the_replica_a_survivor_keeps():
    # node-1 is new (it holds nothing); node-2 keeps rank 1's replica (it was node-1's buddy).
    memory = {"node-0": [_held(0, 3, 12, 11)], "node-2": [_held(2, 3, 12, 11)]}
    replicas = {"node-2": [_kept(1, 3, 12, 11)], "node-0": [_kept(2, 3, 12)]}
    done = plan(
        _world(3),
        memory,
        1,
        persist_on_fault=True,
        restarted=True,
        committed_step=8,
        replicas=replicas,
    )
    assert (done.restore, done.persist_step) == ("memory:12", 12)
    assert done.fetches == (Fetch("node-1", 0, 1, "node-2", step=12),)
    assert done.why == "every rank holds step 12 in memory (rank 1 from node-2: replicas)"

    # The replica lags one step: the common step is the one it has.
    replicas["node-2"] = [_kept(1, 3, 11, 10)]
    assert (
        plan(
            _world(3),
            memory,
            1,
            persist_on_fault=False,
            restarted=True,
            committed_step=8,
            replicas=replicas,
        ).restore
        == "memory:11"
    )

    # A replica of another world's rank, or none at all: storage, and the plan says which rank.
    for kept in ({"node-2": [_kept(1, 4, 12)]}, {}):
        lost = plan(
            _world(3),
            memory,
            1,
            persist_on_fault=True,
            restarted=True,
            committed_step=8,
            replicas=kept,
        )
        assert (lost.restore, lost.fetches) == ("storage", ())
        assert lost.why == "rank 1 (node-1) holds no step in memory"


def test_a_node_does_not_fetch_its_own_ranks_from_itself():
    # node-1 runs rank 1 again but lost its memory (a restarted node); a replica it keeps of
    # rank 1 (a stale one: ranks moved) does not count.
    memory = {"node-0": [_held(0, 2, 5)]}
    done = plan(
        _world(2),
        memory,
        1,
        persist_on_fault=False,
        restarted=True,
        committed_step=0,
        replicas={"node-1": [_kept(1, 2, 5)]},
    )
    assert done.restore == "storage"
