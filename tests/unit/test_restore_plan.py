"""Where a new round's workers restore from, and what the timeline says of it: a fresh start
is not called a restore from storage."""

from __future__ import annotations

from planaria.master.restore import RestorePlan, plan
from planaria.protocol import MemoryHolding, RendezvousInfo


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
