"""Hang detection on a node: no step progress for too long while the workers are alive.

Pure logic with an explicit clock, fed with the progress board. The timer of an attempt starts
at its first step report (any local rank's): start-up, imports, ``init_process_group`` and
checkpoint loading take as long as they take, which no single timeout fits both for a toy model
and for a large one loading terabytes. That phase has its own, optional and typically much
longer ``first_step_timeout``. From the first step on, a rank whose step has not changed for
``hang_timeout`` is hung; in synchronous training one hung rank soon holds every other rank in
its next collective, so every node notices, each for its own ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planaria.progress import Progress


@dataclass(frozen=True)
class Stall:
    """A rank without progress: its last step (-1: none yet) and for how long it has stood."""

    local_rank: int
    step: int
    stalled_s: float


class HangWatch:
    def __init__(
        self, hang_timeout: float, started: float, first_step_timeout: float | None = None
    ) -> None:
        self.hang_timeout = hang_timeout
        self.first_step_timeout = first_step_timeout
        self.started = started
        self.first_step_at: float | None = None
        self._seen: dict[int, tuple[int, float]] = {}  # local rank -> (step, when it changed)

    def observe(self, slots: Sequence[Progress], now: float) -> list[Stall]:
        """Feed the board. Once any rank stood for its timeout, returns every local rank's
        stall (the reader wants all stacks of the node); else []."""
        for rank, slot in enumerate(slots):
            if slot.step < 0:
                continue
            if self.first_step_at is None:
                self.first_step_at = now
            seen = self._seen.get(rank)
            if seen is None or seen[0] != slot.step:
                self._seen[rank] = (slot.step, now)
        if self.first_step_at is None:
            limit = self.first_step_timeout
            if limit is not None and now - self.started >= limit:
                return [Stall(r, -1, now - self.started) for r in range(len(slots))]
            return []
        stalls = []
        for rank in range(len(slots)):
            step, since = self._seen.get(rank, (-1, self.first_step_at))
            stalls.append(Stall(rank, step, now - since))
        hung = any(s.stalled_s >= self.hang_timeout for s in stalls)
        return stalls if hung else []
