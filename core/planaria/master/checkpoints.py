"""The job's checkpoints as the master sees them: what was committed, what failed, what a
restore had to skip, and what that means for the job's end.

Nodes report through ``/v1/checkpoint/event``: their persisters' events, their persisters'
restarts, and what their workers' restores found. A job whose training command succeeded on
every node ends succeeded only if the last step it asked to persist is committed, or if
``checkpoint.allow_unpersisted_end`` accepts less; either way the reason says "last persisted
step N of M". Committed steps of which none verifies are a start from scratch, in the timeline
and the summary, and an error that stops the job with ``checkpoint.require_restore``.
"""

from __future__ import annotations

from planaria import events
from planaria.master.timeline import Timeline
from planaria.protocol import CheckpointEvent, CheckpointSpec


class JobCheckpoints:
    def __init__(self, spec: CheckpointSpec | None, timeline: Timeline) -> None:
        self.spec = spec
        self.timeline = timeline
        self.committed = 0
        self.committed_step = -1
        self.failed_step = -1
        self.failed_error = ""
        self.skipped: dict[int, str] = {}
        """Steps a restore skipped, and the first reason given."""
        self.scratch = ""
        """Why training started from scratch although committed steps exist."""
        self.persister_restarts = 0

    def event(self, node: str, report: CheckpointEvent) -> str | None:
        """Put ``report`` in the timeline; the reason to stop the job, if it is one."""
        kind, step, rank = report.event, report.step, report.rank
        on = f"{node}{'' if rank is None else f' (rank {rank})'}"
        if kind == "checkpoint_committed":
            self.committed_step = max(self.committed_step, step)
            self.committed += 1
            size = f"{(report.bytes or 0) / 2**20:.1f} MiB"
            self.timeline.emit(
                events.CheckpointCommitted(bytes=report.bytes, seconds=report.seconds),
                f"checkpoint step {step} committed ({size}, {report.seconds or 0:.2f}s)",
                node=node,
                step=step,
            )
        elif kind == "persist_failed":
            if step > self.failed_step:
                self.failed_step, self.failed_error = step, report.error
            self.timeline.emit(
                events.CheckpointFailed(error=report.error),
                f"persisting step {step} failed on {on}: {report.error}",
                node=node,
                step=step,
                rank=rank,
            )
        elif kind == "persister_restarted":
            self.persister_restarts += 1
            self.timeline.emit(
                events.PersisterRestarted(error=report.error),
                f"the checkpoint persister of {node} died ({report.error}) and was restarted; "
                "its workers reconnect and persist again what was pending",
                node=node,
            )
        elif kind == "checkpoint_skipped":
            self.skipped.setdefault(step, report.error)
            self.timeline.emit(
                events.CheckpointSkipped(error=report.error),
                f"checkpoint step {step} skipped at restore by {on}: {report.error}",
                node=node,
                step=step,
                rank=rank,
            )
        elif kind == "started_from_scratch":
            required = self.spec is not None and self.spec.require_restore
            if not required:
                self.scratch = report.error
            self.timeline.emit(
                events.StartedFromScratch(
                    error=report.error, steps=report.steps, required=required
                ),
                f"nothing restorable: {report.error}; "
                + ("checkpoint.require_restore stops the job" if required else
                   "training started from scratch"),
                node=node,
            )  # fmt: skip
            if required:
                return (
                    f"nothing to restore: {report.error}, and checkpoint.require_restore is "
                    "set: repair or remove those steps, or unset it to start from scratch"
                )
        return None

    def unpersisted(self, last_step: int) -> str:
        """What the job's end lacks when the last step it asked to persist failed, else ""."""
        if self.failed_step <= self.committed_step:
            return ""
        last = max(last_step, self.failed_step)
        persisted = str(self.committed_step) if self.committed_step >= 0 else "none"
        return (
            f"last persisted step {persisted} of {last} (persisting step {self.failed_step} "
            f"failed: {self.failed_error})"
        )

    def end(self, last_step: int) -> tuple[bool, str]:
        """(succeeded, why) for a job whose training command succeeded on every node."""
        done = "the training command succeeded on every node"
        lost = self.unpersisted(last_step)
        if not lost:
            return True, done
        if self.spec is not None and self.spec.allow_unpersisted_end:
            return True, f"{done}; {lost} (accepted: checkpoint.allow_unpersisted_end)"
        return False, (
            f"{done}, but its last checkpoint was not persisted: {lost}; "
            "set checkpoint.allow_unpersisted_end: true to accept this"
        )
