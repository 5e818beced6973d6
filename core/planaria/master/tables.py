"""The summary as tables people read: the lines ``planaria run`` prints at the end and
``planaria report`` shows, the faults (the first and the last ones, those between counted by
kind), the faults by kind and the stragglers. Words and layout only: the figures are the
summary's (:mod:`planaria.master.summary`)."""

from __future__ import annotations

from dataclasses import dataclass

from planaria.master.summary import NO_STEPS, Fault, Summary


@dataclass(frozen=True)
class Row:
    """A line of the summary as ``planaria run`` prints it (and ``planaria report`` shows it)."""

    what: str
    value: str
    alarm: bool = False


def summary_rows(summary: Summary) -> list[Row]:
    rows = [Row("result", f"{summary.state}: {summary.reason}")]
    rows.append(
        Row("steps done", str(summary.steps) if summary.stepped else f"unknown: {NO_STEPS}")
    )
    rows.append(Row("wall time", f"{summary.wall_s:.2f}s"))
    if summary.startup_s is not None:
        rows.append(Row("start-up (to first step)", f"{summary.startup_s:.2f}s"))
    rows.append(Row("restarts", str(summary.restarts)))
    rows.append(Row("downtime (recovery)", f"{summary.downtime_s:.2f}s"))
    rows.append(Row("goodput", _goodput(summary)))
    if summary.tokens is not None:
        rows.append(Row("tokens", _tokens(summary)))
    if summary.checkpoints:
        last = f"{summary.checkpoints} (last: step {summary.last_checkpoint})"
        rows.append(Row("checkpoints committed", last))
    if summary.unpersisted:
        rows.append(Row("not persisted", summary.unpersisted, alarm=True))
    if summary.persister_restarts:
        rows.append(Row("persister restarts", str(summary.persister_restarts)))
    if summary.skipped_checkpoints:
        rows.append(Row("skipped checkpoints", "\n".join(summary.skipped_checkpoints)))
    if summary.started_from_scratch:
        rows.append(Row("started from scratch", summary.started_from_scratch, alarm=True))
    if summary.not_written:
        rows.append(Row("not written", "\n".join(summary.not_written), alarm=True))
    failed = summary.failed_rank
    if failed is not None:
        where = f"rank {failed.rank} (node {failed.node}) {failed.description}"
        rows.append(Row("failed rank", where + (f"; its log: {failed.log}" if failed.log else "")))
    return rows


GOODPUT = "time training over wall time: start-up and recovery count against it"


def _goodput(summary: Summary) -> str:
    """The goodput with its definition and the figures it came from: a bare percentage reads
    as training efficiency, while a short job's start-up alone can take most of it."""
    goodput = summary.goodput
    if goodput is None:
        return f"unknown: no step reported ({GOODPUT})"
    lost = f"{summary.wall_s:.2f}s wall time - {summary.startup_s or 0.0:.2f}s start-up - "
    lost += f"{summary.downtime_s:.2f}s recovery"
    return f"{goodput:.1%}: {GOODPUT} (({lost}) / {summary.wall_s:.2f}s)"


def _tokens(summary: Summary) -> str:
    """The tokens processed and their mean rate over the training time, with where that time
    came from (as the goodput says it)."""
    tokens = summary.tokens or 0.0
    text = f"{si(tokens)} ({tokens:,.0f})"
    rate = summary.tokens_per_s
    if rate is not None:
        text += (
            f"; {si(rate)} tokens/s mean over {summary.training_s:.2f}s of training "
            "(wall time - start-up - recovery)"
        )
    return text


SI = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def si(value: float) -> str:
    """``value`` to three significant digits with its SI suffix: ``45.6k``, ``1.23M``."""
    for scale, suffix in SI:
        if abs(value) >= scale * 0.9995:  # what rounds up to the next suffix reads with it
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


FAULT_COLUMNS = ("fault", "class", "detail", "action", "restored from", "recovery", "steps lost")
FIRST_FAULTS = 5
LAST_FAULTS = 15
"""A summary lists the first and the last faults, one row each; the faults between are one
row that counts them by kind: a job through a thousand restarts prints a page, not a book."""


def fault_rows(
    summary: Summary, first: int = FIRST_FAULTS, last: int = LAST_FAULTS
) -> list[tuple[str, ...]]:
    """One row of :data:`FAULT_COLUMNS` a fault: the ``first`` ones and the ``last`` ones,
    and between them one row saying how many more there were, of which kinds."""
    faults = summary.faults
    if len(faults) <= first + last:
        return [_fault_row(f) for f in faults]
    between = faults[first : len(faults) - last]
    more = f"... {len(between)} more faults: {_by_kind(between)}"
    gap = ("...", "", more, "", "", "", "")
    return [
        *(_fault_row(f) for f in faults[:first]),
        gap,
        *(_fault_row(f) for f in faults[len(faults) - last :]),
    ]


def _fault_row(fault: Fault) -> tuple[str, ...]:
    recovery = "-" if fault.recovery_s is None else f"{fault.recovery_s:.2f}s"
    lost = "-" if fault.steps_lost is None else str(fault.steps_lost)
    if fault.steps_lost is not None and fault.lower_bound:
        lost = f"at least {lost}"
    verdict = f"{fault.fault_class}: {fault.reason}" if fault.fault_class else "-"
    restored = fault.restored_from or "-"
    return (fault.kind, verdict, fault.detail, fault.action, restored, recovery, lost)


def fault_kind(fault: Fault) -> str:
    """``worker_failed (transient)``: what faults are counted by."""
    return fault.kind + (f" ({fault.fault_class})" if fault.fault_class else "")


def _by_kind(faults: list[Fault]) -> str:
    counts: dict[str, int] = {}
    for fault in faults:
        counts[fault_kind(fault)] = counts.get(fault_kind(fault), 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{count} {kind}" for kind, count in ranked)


FAULT_KIND_COLUMNS = ("fault", "count", "recovered", "mean recovery", "steps lost")


def fault_kind_rows(summary: Summary) -> list[tuple[str, ...]]:
    """The faults counted by kind (and class), most frequent first: one row a kind."""
    kinds: dict[str, list[Fault]] = {}
    for fault in summary.faults:
        kinds.setdefault(fault_kind(fault), []).append(fault)
    rows: list[tuple[str, ...]] = []
    for kind, faults in sorted(kinds.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        took = [f.recovery_s for f in faults if f.recovery_s is not None]
        lost = [f.steps_lost for f in faults if f.steps_lost is not None]
        mean = f"{sum(took) / len(took):.2f}s" if took else "-"
        rows.append((kind, str(len(faults)), str(len(took)), mean, str(sum(lost)) if lost else "-"))
    return rows


STRAGGLER_COLUMNS = ("rank", "node", "measure", "per step", "others' median", "ratio")


def straggler_rows(summary: Summary) -> list[tuple[str, ...]]:
    return [
        (
            str(s.rank),
            s.node,
            s.metric,
            f"{s.seconds * 1000:.1f} ms",
            f"{s.others_s * 1000:.1f} ms",
            f"{s.ratio:.1f}x",
        )
        for s in summary.stragglers
    ]
