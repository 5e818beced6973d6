"""Rendezvous round logic: closing rules, node_unit, rank keeping."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from planaria.master.rounds import Rounds


def rounds(min_nodes=2, max_nodes=4, unit=1, grace=10.0, procs=2) -> Rounds:
    r = Rounds(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        node_unit=unit,
        join_grace=grace,
        procs_per_node=procs,
    )
    r.open(0.0)
    return r


def test_closes_at_max_at_once():
    r = rounds(max_nodes=2)
    r.join("a", "10.0.0.1", 1111, 0.1)
    assert not r.ready({"a", "b"}, 0.2)
    r.join("b", "10.0.0.2", 2222, 0.3)
    assert r.ready({"a", "b"}, 0.3)
    world = r.close()
    assert {n: i.node_rank for n, i in world.items()} == {"a": 0, "b": 1}
    b = world["b"]
    assert (b.world_size, b.rank_offset, b.num_nodes) == (4, 2, 2)
    assert (b.master_addr, b.master_port) == ("10.0.0.1", 1111)
    assert not b.agent_store  # rank 0's worker hosts the store
    # Left out of the wire while false: an agent from before the field reads it.
    assert set(json.loads(b.model_dump_json())) == {
        "round", "node_rank", "num_nodes", "rank_offset", "world_size", "master_addr",
        "master_port",
    }  # fmt: skip


def test_a_store_off_the_workers_is_every_members_address_and_survives_the_journal():
    r = rounds(max_nodes=2)
    r.join("a", "10.0.0.1", 1111, 0.1)
    r.join("b", "10.0.0.2", 2222, 0.2)
    world = r.close(("10.0.0.9", 40000))
    assert {(i.master_addr, i.master_port, i.agent_store) for i in world.values()} == {
        ("10.0.0.9", 40000, True)
    }
    again = rounds(max_nodes=2)
    again.restore(r.snapshot(), 1.0)
    assert again.world == world
    assert json.loads(world["a"].model_dump_json())["agent_store"] is True


def test_waits_for_expected_nodes_then_for_the_grace():
    r = rounds(min_nodes=2, max_nodes=4, grace=10.0)
    r.join("a", "h", 1, 1.0)
    r.join("b", "h", 2, 2.0)
    expected = {"a", "b", "c"}
    assert not r.ready(expected, 5.0)  # c is on its way
    assert r.ready(expected, 12.0)  # nobody came for join_grace
    assert r.ready({"a", "b"}, 2.0)  # everyone expected is here


def test_below_min_never_closes():
    r = rounds(min_nodes=3, max_nodes=4)
    r.join("a", "h", 1, 0)
    r.join("b", "h", 2, 0)
    assert not r.ready({"a", "b"}, 100.0)


def test_node_unit_cuts_the_world_and_the_rest_stands_by():
    r = rounds(min_nodes=2, max_nodes=8, unit=2)
    for i, n in enumerate("abc"):
        r.join(n, "h", 100 + i, float(i))
    assert r.ready({"a", "b", "c"}, 3.0)
    world = r.close()
    assert sorted(world) == ["a", "b"]
    assert r.standby() == ["c"]


def test_survivors_keep_their_ranks_and_newcomers_fill_holes():
    r = rounds(min_nodes=3, max_nodes=3)
    for i, n in enumerate("abc"):
        r.join(n, f"h{n}", 100 + i, float(i))
    assert {n: i.node_rank for n, i in r.close().items()} == {"a": 0, "b": 1, "c": 2}
    # b dies; d replaces it; c and a rejoin first.
    r.leave("b")
    r.open(10.0)
    r.join("c", "hc", 300, 10.1)
    r.join("a", "ha", 301, 10.2)
    r.join("d", "hd", 302, 11.0)
    world = r.close()
    assert {n: i.node_rank for n, i in world.items()} == {"a": 0, "c": 2, "d": 1}
    assert world["d"].master_addr == "ha" and world["d"].master_port == 301


def test_shrinking_reassigns_ranks_that_no_longer_fit():
    r = rounds(min_nodes=1, max_nodes=3)
    for i, n in enumerate("abc"):
        r.join(n, "h", i + 1, float(i))
    r.close()
    r.leave("a")
    r.open(5.0)
    r.join("c", "h", 9, 5.0)
    r.join("b", "h", 8, 5.1)
    world = r.close()
    # Two nodes: c had rank 2, which no longer fits; it takes the free rank 0.
    assert {n: i.node_rank for n, i in world.items()} == {"b": 1, "c": 0}
    assert world["b"].master_port == 9


@given(
    st.integers(min_value=1, max_value=6),
    st.integers(min_value=0, max_value=6),
    st.integers(min_value=1, max_value=3),
    st.integers(min_value=0, max_value=12),
)
def test_closed_worlds_are_contiguous_and_cut_to_the_unit(low, extra, unit, joiners):
    high = low + extra
    r = rounds(min_nodes=low, max_nodes=high, unit=unit)
    names = [f"n{i}" for i in range(joiners)]
    for i, n in enumerate(names):
        r.join(n, "h", 1000 + i, float(i))
    if not r.ready(set(names), 1000.0):
        size = min(joiners, high) // unit * unit
        assert size < low or size == 0
        return
    world = r.close()
    size = len(world)
    assert size % unit == 0 and low <= size <= high
    assert sorted(i.node_rank for i in world.values()) == list(range(size))
    assert all(i.world_size == size * 2 for i in world.values())
