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

from typing import Any

from planaria import events
from planaria.checkpoint.persisted import PersistedCheckpoints
from planaria.log import get_logger
from planaria.master.timeline import Timeline
from planaria.protocol import CheckpointEvent, CheckpointSpec

log = get_logger("master")


class Fence:
    """The oldest round whose checkpoints may still be committed, kept in the job's storage
    (:meth:`~planaria.checkpoint.persisted.PersistedCheckpoints.fence`) where every node's
    committer reads it: a node declared lost may still be training somewhere, cut off; what
    it saves after the fence is never committed."""

    def __init__(self, spec: CheckpointSpec | None) -> None:
        self.spec = spec
        self.generation = 0

    def raise_to(self, generation: int, node: str) -> None:
        if self.spec is None or generation <= self.generation:
            return
        try:
            PersistedCheckpoints.open(self.spec.storage).fence(generation)
        except Exception as exc:  # storage down: the round checks still hold the rest
            log.error("cannot write the checkpoint fence", node=node, error=str(exc))
            return
        self.generation = generation
        log.info("checkpoints of earlier rounds fenced", generation=generation, node=node)


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

    _KEPT = (
        "committed",
        "committed_step",
        "failed_step",
        "failed_error",
        "scratch",
        "persister_restarts",
    )

    def snapshot(self) -> dict[str, Any]:
        return {
            **{k: getattr(self, k) for k in self._KEPT},
            "skipped": {str(s): why for s, why in self.skipped.items()},
        }

    def restore(self, snapshot: dict[str, Any]) -> None:
        for key in self._KEPT:
            setattr(self, key, snapshot[key])
        self.skipped = {int(s): str(why) for s, why in dict(snapshot["skipped"]).items()}

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
