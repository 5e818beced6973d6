"""What the master's process sets for itself to hold thousands of agents.

- Open files: each agent holds a connection (two while a progress report overlaps its long
  poll), so the soft limit is raised to the hard one; a hard limit too low for the job's nodes
  is said at start, not found as ``EMFILE`` in the middle of a rendezvous.
- The garbage collector: the master's state (nodes, rounds, the world's ranks, the imported
  modules and their pydantic schemas) is large and long-lived, while a request leaves mostly
  acyclic garbage that reference counting frees at once. With CPython's default thresholds the
  full collections that a steady stream of requests sets off walk that whole state again and
  again: at 10,000 agents they took most of the master's time and stopped its loop for seconds
  (measured by ``benchmarks/control_plane.py``: 1,100 heartbeats a second with them, 6,600
  without). So what exists once the API serves is frozen out of the collector's sight
  (``gc.freeze``) and collections run less often; cycles are still collected.

Both are the whole process's settings, left in place: ``planaria run`` is the master's own
process. A program that runs a master in its own process takes them along.
"""

from __future__ import annotations

import gc
import resource

from planaria.log import get_logger

log = get_logger("master")

GC_THRESHOLDS = (100_000, 50, 1000)
"""Allocations before a young collection, and young (then middle) collections before an older
one: CPython's defaults are (700, 10, 10) (2,000 young allocations from 3.13 on)."""


def prepare(nodes: int) -> None:
    """Set the process up for a job of ``nodes`` nodes."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * nodes + 256
    if soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, raised), hard))
        if raised < wanted:
            log.warning(
                "the open-file limit is too low for this many nodes' connections",
                nodes=nodes,
                limit=raised,
                wanted=wanted,
                fix="raise the hard limit (ulimit -Hn, LimitNOFILE=, a container's nofile)",
            )
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
