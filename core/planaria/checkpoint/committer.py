"""Committing persisted steps: a step is committed once every rank's shard of it is in.

The persister that wrote rank 0's shard of a step hands the step to its committer, which waits
until every rank's record is in ``step-N.partial/``. A step that will never get them all is given
up, and its partial removed, as soon as that is certain, so that it holds up neither the steps
after it nor the persister's exit:

- a rank left its ``rank-R.failed`` marker (its shard could not be written): given up once every
  rank is accounted for, so that no rank still writing puts the directory back afterwards;
- a newer step of the same storage is ready: it makes the older one moot;
- ``commit_timeout`` passed since the step was handed over (a rank that never came);
- the persister is stopping: every waiting step gets one grace period in all, not one each.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from planaria.checkpoint.persisted import PersistedCheckpoints
from planaria.errors import PlanariaError, StorageError
from planaria.log import get_logger

log = get_logger("persister")

Emit = Callable[..., None]


@dataclass
class Commit:
    store: PersistedCheckpoints
    step: int
    world: int
    done: Callable[[str | None], None] = lambda error: None
    """Called with None once committed, else with why not."""
    cleanup: bool = False
    """Rank 0's own shard failed: only remove the partial once every rank is accounted for."""
    since: float = field(default_factory=time.monotonic)
    generation: int = 0
    """The round that saved the step (see :meth:`PersistedCheckpoints.fence`)."""


class Committer:
    def __init__(self, emit: Emit, timeout: float) -> None:
        self.emit = emit
        self.timeout = timeout
        self._queue: queue.Queue[Commit | None] = queue.Queue()
        self._deadline: float | None = None
        self._thread = threading.Thread(target=self._run, name="commit", daemon=True)
        self._thread.start()

    def submit(self, commit: Commit) -> None:
        self._queue.put(commit)

    def stop(self, grace: float, timeout: float) -> None:
        """Commit what is ready; give up, after ``grace``, on what still waits for a shard."""
        self._deadline = time.monotonic() + grace
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        waiting: list[Commit] = []
        stopping = False
        delay = 0.01
        while waiting or not stopping:
            try:
                item = self._queue.get(timeout=delay) if waiting else self._queue.get()
            except queue.Empty:
                delay = min(delay * 2, 0.5)
            else:
                if item is None:
                    stopping = True
                else:
                    waiting.append(item)
                    delay = 0.01
                    continue  # take whatever else is queued before looking at storage
            waiting = self._advance(waiting)

    def _advance(self, waiting: list[Commit]) -> list[Commit]:
        """Commit the steps that are complete, give up the ones that never will be; the rest."""
        progress: dict[int, tuple[set[int], set[int]]] = {}
        for c in waiting:
            try:
                have, failed = c.store.commit_progress(c.step, c.world)
            except (OSError, PlanariaError) as exc:
                log.warning("cannot see a step's shards", step=c.step, error=str(exc))
                have, failed = set(), set()
            progress[id(c)] = (have, failed - have)  # a shard written again after a failure

        def ready(c: Commit) -> bool:
            have, failed = progress[id(c)]
            return not c.cleanup and not failed and len(have) == c.world

        newest_ready: dict[int, int] = {}
        for c in filter(ready, waiting):
            newest_ready[id(c.store)] = max(newest_ready.get(id(c.store), -1), c.step)
        left = []
        now = time.monotonic()
        for c in sorted(waiting, key=lambda c: c.step):
            if ready(c):
                self._commit(c)
                continue
            have, failed = progress[id(c)]
            why = None
            newer = newest_ready.get(id(c.store), -1)
            if failed and len(have | failed) >= c.world:
                ranks = ", ".join(map(str, sorted(failed)))
                why = f"rank {ranks} could not write its shard"
            elif newer > c.step:
                why = f"superseded by step {newer}: not every rank's shard arrived"
            elif now - c.since > self.timeout:
                why = f"not every rank's shard arrived within {self.timeout:g}s"
            elif self._deadline is not None and now > self._deadline:
                why = "stopped before every rank's shard arrived"
            if why is None:
                left.append(c)
            else:
                self._give_up(c, why)
        return left

    def _commit(self, c: Commit) -> None:
        try:
            manifest = c.store.commit(c.step, c.world, c.generation)
        except (OSError, PlanariaError, ValueError) as exc:
            self._give_up(c, f"commit: {exc}")
            return
        self.emit(
            "checkpoint_committed",
            step=c.step,
            world=c.world,
            bytes=sum(f.size for f in manifest.files.values()),
            seconds=round(time.monotonic() - c.since, 4),
        )
        c.done(None)

    def _give_up(self, c: Commit, why: str) -> None:
        with contextlib.suppress(StorageError, OSError):
            c.store.abandon(c.step)
        if c.cleanup:
            return  # rank 0's own failure was reported when it happened
        fields: dict[str, Any] = {"step": c.step, "rank": 0, "error": f"commit: {why}"}
        self.emit("persist_failed", **fields)
        c.done(f"step {c.step}: not committed: {why}")
