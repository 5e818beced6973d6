"""Rank placements: ``topology`` groups nodes of one switch, ``stable`` ranks by arrival, both
keep survivors' ranks; the master's rounds use the configured one and overrule a broken one."""

from __future__ import annotations

import pytest

from planaria.master.rounds import Rounds
from planaria.plugin.records import NoOptions
from planaria.rendezvous.api import Candidate, PlacementError, RankPlacement, check_placement
from planaria.rendezvous.builtin import StablePlacement, TopologyOptions, TopologyPlacement


def topology(label: str = "switch") -> TopologyPlacement:
    return TopologyPlacement(TopologyOptions(label=label))


def node(name: str, joined: float, switch: str | None, rank: int | None = None) -> Candidate:
    return Candidate(name, joined, rank, {} if switch is None else {"switch": switch})


# Join order interleaves the switches: a, b on s1 and x, y on s2 arrive as a, x, b, y.
FIRST = [node("a", 1, "s1"), node("x", 2, "s2"), node("b", 3, "s1"), node("y", 4, "s2")]


def test_the_first_round_groups_two_switches_of_two_nodes():
    assert topology().place(FIRST, 4) == {"a": 0, "b": 1, "x": 2, "y": 3}
    # stable ranks the same round by arrival, across the switches.
    assert StablePlacement().place(FIRST, 4) == {"a": 0, "x": 1, "b": 2, "y": 3}


def test_a_replacement_on_the_lost_nodes_switch_takes_its_rank_and_survivors_stay():
    before = topology().place(FIRST, 4)
    # b (s1, rank 1) is lost; c comes on s1, after a late z on s2 stood by.
    survivors = [node(n, t, s, before[n]) for n, t, s in (("a", 1, "s1"), ("x", 2, "s2"))]
    survivors.append(node("y", 4, "s2", before["y"]))
    candidates = [*survivors, node("c", 9, "s1")]
    assert topology().place(candidates, 4) == {"a": 0, "c": 1, "x": 2, "y": 3}


def test_a_newcomer_takes_the_free_rank_nearest_its_group():
    # Ranks 1 (s1's) and 3 (s2's) are free; the s2 newcomer comes first but goes next to s2.
    candidates = [
        node("a", 1, "s1", 0),
        node("x", 2, "s2", 2),
        node("n2", 5, "s2"),
        node("n1", 6, "s1"),
    ]
    assert topology().place(candidates, 4) == {"a": 0, "n1": 1, "x": 2, "n2": 3}


def test_nodes_without_the_label_are_each_their_own_group_placed_last():
    candidates = [node("u", 0, None), node("a", 1, "s2"), node("v", 2, None), node("b", 3, "s1")]
    assert topology().place(candidates, 4) == {"b": 0, "a": 1, "u": 2, "v": 3}
    # Another label: nobody has it, so arrival decides.
    assert topology("rack").place(candidates, 4) == {"u": 0, "a": 1, "v": 2, "b": 3}


def test_who_runs_is_decided_by_arrival_not_by_switch():
    candidates = [node("a", 1, "s2"), node("b", 2, "s2"), node("c", 3, "s1")]
    assert topology().place(candidates, 2) == {"a": 0, "b": 1}  # c stands by


def test_a_shrunk_world_keeps_the_ranks_that_still_fit():
    candidates = [node("a", 1, "s1", 0), node("b", 2, "s1", 3), node("x", 3, "s2", 1)]
    assert topology().place(candidates, 2) == {"a": 0, "x": 1}
    assert StablePlacement().place(candidates, 2) == {"a": 0, "x": 1}


def test_check_placement_names_what_is_wrong():
    with pytest.raises(PlacementError, match="not candidates: z"):
        check_placement({"a": 0, "z": 1}, FIRST, 2)
    with pytest.raises(PlacementError, match="placed 3 node"):
        check_placement({"a": 0, "b": 1, "x": 2}, FIRST, 2)
    with pytest.raises(PlacementError, match=r"0\.\.1 each once, got \[0, 0\]"):
        check_placement({"a": 0, "b": 0}, FIRST, 2)
    with pytest.raises(PlacementError, match="integers"):
        check_placement({"a": 0, "b": True}, FIRST, 2)


def rounds(placement: RankPlacement | None = None) -> Rounds:
    r = Rounds(
        min_nodes=4,
        max_nodes=4,
        node_unit=1,
        join_grace=10.0,
        procs_per_node=2,
        placement=placement,
    )
    r.open(0.0)
    return r


def test_rounds_place_by_the_configured_placement_and_rank_0_hosts_the_store():
    r = rounds(topology())
    for i, (name, switch) in enumerate((("a", "s2"), ("x", "s1"), ("b", "s2"), ("y", "s1"))):
        r.join(name, f"10.0.0.{i}", 1000 + i, float(i), {"switch": switch})
    world = r.close()
    assert {n: i.node_rank for n, i in world.items()} == {"x": 0, "y": 1, "a": 2, "b": 3}
    assert (world["a"].master_addr, world["a"].master_port) == ("10.0.0.1", 1001)
    assert world["b"].rank_offset == 6

    # x (rank 0) is lost; z on s1 takes its rank, and with it the store.
    r.leave("x")
    r.open(10.0)
    for i, name in enumerate("ayb"):
        r.join(
            name, f"10.0.0.{9 - i}", 2000 + i, 10.0 + i, {"switch": "s1" if name == "y" else "s2"}
        )
    r.join("z", "10.0.0.5", 3000, 14.0, {"switch": "s1"})
    world = r.close()
    assert {n: i.node_rank for n, i in world.items()} == {"a": 2, "y": 1, "b": 3, "z": 0}
    assert (world["a"].master_addr, world["a"].master_port) == ("10.0.0.5", 3000)


class _Broken(RankPlacement[NoOptions]):
    name = "broken"

    def place(self, candidates, size):
        return {c.node_id: 0 for c in candidates}


class _Raises(RankPlacement[NoOptions]):
    def place(self, candidates, size):
        raise KeyError("switch")


@pytest.mark.parametrize("placement", [_Broken(NoOptions()), _Raises(NoOptions())])
def test_a_broken_placement_is_overruled_by_stable(placement, capsys):
    r = rounds(placement)
    for i, name in enumerate("abcd"):
        r.join(name, "h", 1000 + i, float(i), {"switch": "s1"})
    world = r.close()
    assert {n: i.node_rank for n, i in world.items()} == {"a": 0, "b": 1, "c": 2, "d": 3}
    captured = capsys.readouterr()
    assert "rank placement failed" in captured.out + captured.err
