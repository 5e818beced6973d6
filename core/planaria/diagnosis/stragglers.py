"""Straggler detection: a rank that works ``factor`` times longer per step than the others.

The agent keeps, per local rank, a window of recent per-step times read from the progress board
(:class:`StepTimes`) and sends their medians with its heartbeat: two floats per rank, however
many steps ran. The master compares every rank with the median of the others
(:class:`StragglerDetector`).

Two measures are compared. The busy time (the CPU time of the step, or what the worker passed
to ``monitor.step``) finds the slow rank of synchronous data-parallel training, where every rank
waits for the slowest in each collective so that wall-clock step times are equal everywhere.
The wall-clock step time finds a slow rank when ranks do not wait for each other.
"""

from __future__ import annotations

import operator
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planaria.progress import Progress


class StepTimes:
    """Per local rank: the last ``window`` step times, wall-clock and busy, from board reads.

    The agent polls the board; a rank that made several steps between two reads adds their mean.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self._last: dict[int, tuple[int, float]] = {}
        self._wall: dict[int, deque[float]] = {}
        self._busy: dict[int, deque[float]] = {}

    def observe(self, slots: Sequence[Progress]) -> None:
        for rank, slot in enumerate(slots):
            if slot.step < 0:
                continue
            last = self._last.get(rank)
            if last is not None and slot.step > last[0]:
                wall = self._wall.setdefault(rank, deque(maxlen=self.window))
                wall.append(max(0.0, slot.time - last[1]) / (slot.step - last[0]))
                if slot.busy is not None:
                    self._busy.setdefault(rank, deque(maxlen=self.window)).append(slot.busy)
            if last is None or slot.step != last[0]:
                self._last[rank] = (slot.step, slot.time)

    def medians(self, rank: int) -> tuple[float | None, float | None]:
        """(wall, busy) medians over a full window; None until the window is full."""
        return _median(self._wall.get(rank), self.window), _median(
            self._busy.get(rank), self.window
        )


def _median(values: deque[float] | None, window: int) -> float | None:
    if values is None or len(values) < window:
        return None
    return statistics.median(values)


@dataclass(frozen=True)
class RankTimes:
    node: str
    local_rank: int
    wall_s: float | None
    busy_s: float | None


@dataclass(frozen=True)
class Straggler:
    """A rank flagged as slow: by which measure, its median, and the others' median."""

    rank: int
    node: str
    local_rank: int
    metric: str
    seconds: float
    others_s: float

    @property
    def ratio(self) -> float:
        return self.seconds / self.others_s if self.others_s > 0 else float("inf")

    def describe(self) -> str:
        return (
            f"rank {self.rank} (node {self.node}) is a straggler: {self.metric} time "
            f"{self.seconds * 1000:.1f} ms per step, {self.ratio:.1f}x the other ranks' median "
            f"({self.others_s * 1000:.1f} ms)"
        )


class StragglerDetector:
    """Flags each (node, local rank) once per job."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.flagged: set[tuple[str, int]] = set()

    def check(self, times: Mapping[int, RankTimes]) -> list[Straggler]:
        """``times``: every rank of the running world by global rank. Needs all of them, with
        full windows, to judge: a rank without numbers yet is no baseline.

        O(n log n) in the ranks: one sort per measure, then the ranks are looked at from the
        slowest down, each one's "median of the others" read off the sorted values around its
        own place, until the first that is not slow: every rank faster than it has a value no
        higher and others no faster (a job of 10,000 nodes is checked in milliseconds)."""
        if len(times) < 2:
            return []
        found: list[Straggler] = []
        for metric in ("busy", "wall"):
            of = operator.attrgetter(f"{metric}_s")
            ordered = [(of(t), r) for r, t in times.items()]
            if any(v is None for v, _ in ordered):
                continue
            ordered.sort()
            sorted_values = [v for v, _ in ordered]
            slow = []
            for place in range(len(ordered) - 1, -1, -1):
                value, rank = ordered[place]
                others = median_without(sorted_values, place)
                if others > 0 and value <= self.factor * others:
                    break  # this one is not slow, nor is any faster one
                t = times[rank]
                if others > 0 and (t.node, t.local_rank) not in self.flagged:
                    self.flagged.add((t.node, t.local_rank))
                    slow.append(Straggler(rank, t.node, t.local_rank, metric, value, others))
            found.extend(reversed(slow))
        return found


def median_without(ordered: Sequence[float], place: int) -> float:
    """The median of ``ordered`` (sorted, at least two values) without its value at ``place``,
    in O(1)."""

    def at(k: int) -> float:  # the k-th of the others, in order
        return ordered[k if k < place else k + 1]

    n = len(ordered) - 1
    if n % 2:
        return at(n // 2)
    return (at(n // 2 - 1) + at(n // 2)) / 2
