"""The agent's watch over one attempt of its workers: hang timer, stack dumps, step times."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from planaria.diagnosis.hang import HangWatch
from planaria.diagnosis.messages import DiagnosisSpec, HangReport, HungRank
from planaria.diagnosis.stacks import dump_stacks, process_state
from planaria.diagnosis.stragglers import StepTimes
from planaria.log import get_logger
from planaria.progress import Progress
from planaria.protocol import RankProgress

log = get_logger("agent.diagnosis")


class NodeWatch:
    def __init__(
        self, spec: DiagnosisSpec, node_id: str, round_: int, rank_offset: int, started: float
    ) -> None:
        self.spec = spec
        self.node_id = node_id
        self.round = round_
        self.rank_offset = rank_offset
        self.hang = HangWatch(spec.hang_timeout, started, spec.first_step_timeout)
        self.times = StepTimes(spec.straggler_window)
        self.hang_reported = False

    def progress(self, slots: Sequence[Progress]) -> list[RankProgress]:
        """The heartbeat's view of the board, with each rank's median step times."""
        out = []
        for rank, slot in enumerate(slots):
            wall, busy = self.times.medians(rank)
            out.append(
                RankProgress(
                    local_rank=rank,
                    step=slot.step,
                    time=slot.time,
                    step_s=wall,
                    busy_s=busy,
                    first_step=slot.first,
                    # The worker writes finite figures only; a NaN in the JSON would cost the
                    # whole heartbeat.
                    loss=_finite(slot.loss),
                    loss_step=slot.loss_step,
                    tokens=_finite(slot.tokens),
                    tokens_step=slot.tokens_step,
                )
            )
        return out

    async def tick(
        self,
        slots: Sequence[Progress],
        pids: Mapping[int, int],
        alive: bool,
        report: Callable[[HangReport], Awaitable[object]],
        now: float | None = None,
    ) -> None:
        """Feed one board read. When the workers are alive and hung, dump their stacks and
        ``report`` it, once per attempt."""
        self.times.observe(slots)
        if self.hang_reported or not alive:
            return
        now = time.time() if now is None else now
        stalls = self.hang.observe(slots, now)
        if not stalls:
            return
        self.hang_reported = True
        first_step = self.hang.first_step_at is None
        timeout = self.spec.first_step_timeout if first_step else self.spec.hang_timeout
        log.warning(
            "workers hung; dumping their stacks",
            ranks=[self.rank_offset + s.local_rank for s in stalls],
            timeout=timeout,
        )
        states = {lr: process_state(pid) for lr, pid in pids.items()}
        stacks = await dump_stacks(dict(pids))
        ranks = [
            HungRank(
                rank=self.rank_offset + s.local_rank,
                local_rank=s.local_rank,
                pid=pids.get(s.local_rank, 0),
                step=s.step,
                stalled_s=round(s.stalled_s, 3),
                state=states.get(s.local_rank, "gone"),
                stack=stacks.get(s.local_rank, "no stack: the worker is gone"),
            )
            for s in stalls
        ]
        await report(
            HangReport(
                node_id=self.node_id,
                round=self.round,
                timeout=timeout or 0.0,
                first_step=first_step,
                ranks=ranks,
                time=now,
            )
        )


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
