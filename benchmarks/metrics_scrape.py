"""What a Prometheus scrape of the master costs at 10,000 nodes, next to a ``/v1/status``.

Both are one pass over the nodes on the master's loop; while one is served no heartbeat is.
The job is a real :class:`~planaria.master.job.Master` in a running round of ``--nodes`` nodes
(2 ranks each) whose heartbeats brought their ranks' step times (so each node has its step
time series), one straggler flagged, and a few hundred events counted. The figures are the
median, min and max over ``--runs`` calls of each, interleaved, in one process: building the
exposition text (:meth:`JobMetrics.exposition`, what ``GET /metrics`` answers) and building
the status reply and its JSON (what ``GET /v1/status`` answers), the baseline. No HTTP: the
transfer is the same kind of work for both and not the master's loop's.

Run:  python benchmarks/metrics_scrape.py [--nodes 10000] [--runs 15]
The last line printed is one JSON object with the medians and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from planaria import events
from planaria.master.job import Master
from planaria.master.metrics import JobMetrics
from planaria.master.state import JobSettings, JobState, Node, NodePhase
from planaria.protocol import Heartbeat, JobSpec, RankProgress
from planaria.scheduler.local import LocalOptions, LocalScheduler


def _master(run_dir: Path, nodes: int) -> Master:
    spec = JobSpec(
        job="bench", run_id="bench-1", run_dir=str(run_dir), command=["true"],
        workdir=str(run_dir), env={}, procs_per_node=2, max_restarts=3,
        heartbeat_interval=2.0, heartbeat_timeout=15.0, stop_grace=1.0, preload=[],
    )  # fmt: skip
    settings = JobSettings(
        spec=spec, min_nodes=nodes, max_nodes=nodes, node_unit=1, join_grace=1.0,
        join_timeout=60.0,
    )  # fmt: skip
    master = Master(settings, LocalScheduler(LocalOptions()), run_dir)
    now = time.time()
    master.open_round()
    for i in range(nodes):
        node = master.fleet.add(Node(f"node-{i}", f"host-{i}", NodePhase.RUNNING))
        master.rounds.join(node.node_id, "127.0.0.1", 29500, now)
    master.rounds.close()
    master.state = JobState.RUNNING
    # Every node's heartbeat but the last brings its ranks' step times: with all of them the
    # straggler check would compare every rank with every other one, at each heartbeat.
    for i in range(nodes - 1):
        node = master.nodes[f"node-{i}"]
        beat = Heartbeat(
            node_id=node.node_id,
            round=master.round,
            activity="running",
            progress=[
                RankProgress(local_rank=r, step=100, time=now, step_s=0.1, busy_s=0.08)
                for r in range(2)
            ],
            wait=False,
        )
        node.step = 100
        master.diagnosis.progress(node, beat)
    master.diagnosis.detector.flagged.add((f"node-{nodes // 2}", 1))  # one straggler
    for step in range(100):
        master.emit(events.CheckpointCommitted(bytes=1 << 30, seconds=1.5), f"step {step}")
    return master


def _time(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()

    async def run() -> dict[str, object]:
        with tempfile.TemporaryDirectory() as tmp:
            master = _master(Path(tmp), args.nodes)
            try:
                metrics = JobMetrics(master)
                text = metrics.exposition().root
                assert f'planaria_node_step_seconds{{node="node-{args.nodes - 2}"}}' in text
                assert f'planaria_node_straggler{{node="node-{args.nodes // 2}"}} 1.0' in text
                scrape, status = [], []
                for _ in range(args.runs):
                    scrape.append(_time(metrics.exposition))
                    status.append(_time(lambda: master.status().model_dump_json()))
            finally:
                master.timeline.close()
        rows = {"GET /metrics (exposition)": scrape, "GET /v1/status (baseline)": status}
        print(f"{args.nodes} nodes, {len(text.splitlines())} lines, {len(text)} bytes a scrape")
        for name, values in rows.items():
            print(
                f"{name:28} median {statistics.median(values) * 1e3:8.1f} ms  "
                f"min {min(values) * 1e3:8.1f}  max {max(values) * 1e3:8.1f}"
            )
        ratio = statistics.median(scrape) / statistics.median(status)
        print(f"scrape / status: {ratio:.2f}")
        return {
            "nodes": args.nodes,
            "scrape_s": statistics.median(scrape),
            "status_s": statistics.median(status),
            "ratio": ratio,
            "bytes": len(text),
        }

    print(json.dumps(asyncio.run(run())))


if __name__ == "__main__":
    sys.exit(main())
