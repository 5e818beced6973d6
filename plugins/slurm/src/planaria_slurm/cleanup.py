"""``python -m planaria_slurm.cleanup RUN_ID NODE_ID [RUN_ID NODE_ID ...]``: run as a job step
on a node when the job stops, removes what those nodes of the run left in this machine's
/dev/shm (an agent killed with SIGKILL cannot clean up after itself)."""

from __future__ import annotations

import sys

from planaria.shm import node_dir, remove_dir


def main(argv: list[str]) -> int:
    if not argv or len(argv) % 2:
        sys.stderr.write("usage: python -m planaria_slurm.cleanup RUN_ID NODE_ID [...]\n")
        return 2
    for run_id, node_id in zip(argv[::2], argv[1::2], strict=True):
        remove_dir(node_dir(run_id, node_id))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
