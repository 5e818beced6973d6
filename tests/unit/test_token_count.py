"""The job's token count from rank 0's per-round sums (:mod:`planaria.master.tokens`)."""

from __future__ import annotations

from planaria.master.tokens import TokenCount


def test_each_rounds_sums_add_up_and_a_late_heartbeat_of_an_old_round_counts_nothing():
    count = TokenCount()
    assert count.sample(1) is None  # nothing reported: no made-up zero
    assert count.heard(1, 100.0) and count.heard(1, 300.0)
    assert not count.heard(1, 300.0)  # the same sum again: the count did not move
    assert count.sample(1) == (300.0, 300.0)
    assert count.heard(2, 50.0)  # new workers: their sum started from zero
    assert not count.heard(1, 999.0)  # a round already over was counted then
    assert count.total == 350.0
    assert count.sample(1) is None


def test_a_round_not_heard_from_yet_starts_its_line_at_the_count_so_far():
    """A round's first step sample may come before a sum of its own (another local rank was
    first): it counts none of its own yet, so the line of its tokens starts where the round
    did and the rate over the round is what its workers really added."""
    count = TokenCount()
    count.heard(1, 700.0)
    assert count.sample(2) == (700.0, 0.0)
    count.heard(2, 200.0)
    assert count.sample(2) == (900.0, 200.0)
    # A master resumed from such a sample counts on from it.
    resumed = TokenCount(700.0, 2, 0.0)
    resumed.heard(2, 200.0)
    assert resumed.total == 900.0
