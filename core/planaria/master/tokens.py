"""The job's tokens: the sum of what rank 0's workers reported, round after round.

A worker sums the tokens of its steps (``planaria.monitor.step(n, tokens=...)``) in its progress
slot, and each heartbeat of rank 0's node brings that sum. The sum is the worker's, not the
master's, because only the worker sees every step: heartbeats come a few times a second at most.
A new round starts new workers, whose sums start from zero again, so the job's count is each
round's last sum added up: :class:`TokenCount` keeps it from the sums as they come. What a
worker reported after the last heartbeat the master heard before a fault is not counted (the
few steps of a heartbeat interval); steps done again after a restore are (it measures work).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenCount:
    """The job's tokens so far, from rank 0's sums; ``total`` is None until one came."""

    total: float | None = None
    round: int = -1
    """The round of the last sum heard."""
    seen: float = 0.0
    """Rank 0's sum in :attr:`round`, as last heard: what the next one adds to."""

    def heard(self, round_: int, tokens: float) -> bool:
        """Rank 0's sum ``tokens`` in ``round_``: count what it adds. Whether the count moved
        (or is known now for the first time)."""
        if round_ < self.round:  # a heartbeat of a round already over: counted then
            return False
        # New workers (a new round): their sum started from zero.
        fresh = round_ != self.round or tokens < self.seen
        added = tokens if fresh else tokens - self.seen
        self.round, self.seen = round_, tokens
        first = self.total is None
        self.total = (self.total or 0.0) + added
        return added > 0 or first

    def sample(self, round_: int) -> tuple[float, float] | None:
        """(The job's tokens, rank 0's sum in ``round_``) for a ``progress`` event of
        ``round_``; None before any sum was heard, or for a round already over. A round whose
        workers' sum is not heard yet has counted none of its own: (the count so far, 0), so
        that a round's tokens line starts where its training did, not at the first heartbeat
        that carried a sum."""
        if self.total is None or round_ < self.round:
            return None
        return self.total, self.seen if round_ == self.round else 0.0
