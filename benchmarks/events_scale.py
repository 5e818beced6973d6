"""What ``planaria status`` and ``planaria report`` cost on a long job's timeline.

A week of training writes gigabytes of ``events.jsonl``, nearly all of it step samples (one a
node every 5 s). This writes a finished run directory whose timeline is ``--size`` megabytes
of events shaped as a master writes them (every line made by :class:`JobEvent` once, as a
template: step samples of ``--nodes`` nodes, a checkpoint a minute, and ``--faults`` faults
each with its restart, round and recovery), its journal and its summary; then runs
``planaria status`` and ``planaria report`` on it, each in its own process, and prints each
one's wall time and peak memory (RSS). The baseline is the same command on a timeline of
``--baseline`` megabytes, in the same run: a command whose cost does not grow with the
timeline has ratios near 1 (status), one that reads it all grows with its size in time only,
never in memory (report). Two more references: status in this process (without the
interpreter's start and imports, most of a command's second), and the large timeline read
with a plain ``json.loads`` loop, the floor of any reading of every line (report's time is
given as a multiple of it).

Run:  python benchmarks/events_scale.py [--size 1000] [--baseline 10] [--nodes 8] [--faults 20]
The last line printed is one JSON object with the figures and the ratios. The run
directories go to a temporary directory (``--where``), removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from planaria import events, status
from planaria.events import JobEvent
from planaria.master.journal import Journal
from planaria.master.state import Node
from planaria.master.summary import Fault, Summary, write_summary

JOB = "bench"
SAMPLE_EVERY = 5.0
CHECKPOINT_EVERY = 12
"""Sample rounds between two checkpoints (a minute)."""


def _template(event: JobEvent, **fields: str) -> str:
    """The event's JSON line with each of ``fields``' sentinel values made a format field."""
    line = event.model_dump_json().replace("{", "{{").replace("}", "}}")
    for name, sentinel in fields.items():
        assert sentinel in line, (name, sentinel, line)
        line = line.replace(sentinel, "{" + name + "}")
    return line


def _templates(nodes: list[str]) -> dict[str, str]:
    def of(payload: events.Payload, message: str, **kw: Any) -> JobEvent:
        return JobEvent.of(payload, job=JOB, message=message, **kw).model_copy(
            update={"time": 1111111111.25}
        )

    t = {"time": "1111111111.25"}
    ranks = {n: i for i, n in enumerate(nodes)}
    return {
        "progress": _template(
            of(events.Progress(round=777), "NODE at step 888888", node="NODE", step=888888),
            **t,
            round="777",
            node="NODE",
            step="888888",
        ),
        "checkpoint": _template(
            of(
                events.CheckpointCommitted(bytes=123456789, seconds=1.5),
                "checkpoint step 888888 committed (117.7 MiB, 1.50s)",
                node=nodes[0],
                step=888888,
            ),
            **t,
            step="888888",
        ),
        "fault": _template(
            of(
                events.FaultDetected(
                    fault="worker_failed",
                    fault_class="transient",
                    reason="killed by SIGKILL",
                    round=777,
                    exitcode=-9,
                    signal=9,
                    host="host-0",
                    log_tail="Traceback ...\nRuntimeError: x",
                ),
                "rank 1 on node-0 failed: killed by SIGKILL",
                node=nodes[0],
                rank=1,
            ),
            **t,
            round="777",
        ),
        "restarted": _template(
            of(
                events.WorkersRestarted(
                    round=777,
                    cause="fault",
                    fault="worker_failed",
                    restart=555,
                    max_restarts=100000,
                ),
                "restarting the workers of every node: round 777 (restart 555)",
            ),
            **t,
            round="777",
            restart="555",
        ),
        "rendezvous": _template(
            of(
                events.RendezvousCompleted(
                    round=777,
                    ranks=ranks,
                    world_size=2 * len(nodes),
                    restore="memory:888888",
                    restore_why="every rank has it",
                ),
                "round 777 closed",
            ),
            **t,
            round="777",
            step="888888",
        ),
        "recovered": _template(
            of(
                events.Recovered(fault="worker_failed", round=777, recovery_s=4.5, steps_lost=3),
                "recovered from worker_failed in 4.50s",
            ),
            **t,
            round="777",
        ),
    }


def write_run(run_dir: Path, megabytes: float, nodes: int = 8, faults: int = 20) -> int:
    """A finished run directory whose timeline is about ``megabytes`` MB; its line count."""
    run_dir.mkdir(parents=True)
    names = [f"node-{i}" for i in range(nodes)]
    tpl = _templates(names)
    target = int(megabytes * 1e6)
    sample = tpl["progress"].format(time="1800000000.000000", round=1, node=names[0], step=10**6)
    per_cycle = (len(sample) + 1) * len(names)
    cycles = max(1, target // per_cycle)
    fault_every = cycles // (faults + 1) if faults else 0
    t0 = 1_800_000_000.0
    lines = 0
    round_, step, restarts = 1, 0, 0
    summary_faults: list[Fault] = []
    with (run_dir / "events.jsonl").open("w", encoding="utf-8") as f:
        first = JobEvent.of(
            events.JobStarted(run_id="bench-1", nodes=names), job=JOB, message="job started"
        ).model_copy(update={"time": t0})
        f.write(first.model_dump_json() + "\n")
        f.write(tpl["rendezvous"].format(time=t0 + 1, round=1, step=0) + "\n")
        lines = 2
        buffer: list[str] = []
        for cycle in range(cycles):
            now = t0 + 2 + cycle * SAMPLE_EVERY
            step += 5
            for node in names:
                buffer.append(
                    tpl["progress"].format(time=f"{now:.6f}", round=round_, node=node, step=step)
                )
            if cycle % CHECKPOINT_EVERY == CHECKPOINT_EVERY - 1:
                buffer.append(tpl["checkpoint"].format(time=f"{now + 0.5:.6f}", step=step))
            if fault_every and cycle % fault_every == fault_every - 1 and restarts < faults:
                restarts += 1
                round_ += 1
                at = now + 1
                buffer += [
                    tpl["fault"].format(time=f"{at:.6f}", round=round_ - 1),
                    tpl["restarted"].format(time=f"{at + 0.2:.6f}", round=round_, restart=restarts),
                    tpl["rendezvous"].format(time=f"{at + 1:.6f}", round=round_, step=step),
                    tpl["recovered"].format(time=f"{at + 4.5:.6f}", round=round_),
                ]
                summary_faults.append(
                    Fault(
                        kind="worker_failed",
                        node=names[0],
                        detail="rank 1: killed by SIGKILL",
                        time=at,
                        action="restart",
                        rank=1,
                        last_step=step,
                        restart_round=round_,
                        recovered_at=at + 4.5,
                        first_step_after=step - 2,
                        restored_from=f"memory (step {step})",
                        fault_class="transient",
                        reason="killed by SIGKILL",
                    )
                )
            if len(buffer) > 10_000:
                f.write("\n".join(buffer) + "\n")
                lines += len(buffer)
                buffer.clear()
        end = t0 + 2 + cycles * SAMPLE_EVERY
        buffer.append(
            JobEvent.of(events.JobFinished(), job=JOB, message="job succeeded")
            .model_copy(update={"time": end})
            .model_dump_json()
        )
        f.write("\n".join(buffer) + "\n")
        lines += len(buffer)
    journal = Journal.create(
        run_dir, {"spec": {"job": JOB, "run_id": "bench-1", "max_restarts": 100000}}
    )
    members = {
        n: Node.from_record({"node_id": n, "host": f"host-{i}", "phase": "succeeded"})
        for i, n in enumerate(names)
    }
    for n in members:
        journal.node_changed(n)
    world = {n: {"node_rank": i} for i, n in enumerate(names)}
    journal.write(
        {
            "job": {"state": "succeeded", "reason": "done"},
            "rounds": {"round": round_, "world": world},
            "recovery": {"restarts": restarts},
        },
        members,
    )
    journal.close()
    write_summary(
        run_dir,
        Summary(
            state="succeeded",
            reason="done",
            steps=step + 1,
            wall_s=end - t0,
            startup_s=2.0,
            downtime_s=4.5 * restarts,
            restarts=restarts,
            faults=summary_faults,
            checkpoints=cycles // CHECKPOINT_EVERY,
        ),
    )
    return lines


def measure(*command: str) -> dict[str, float]:
    """Wall seconds and peak RSS (MB) of ``command`` run to its end in a process of its own."""
    started = time.perf_counter()
    pid = os.posix_spawn(
        command[0],
        list(command),
        os.environ | {"COLUMNS": "200"},
        file_actions=[(os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)],
    )
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed: exit {os.waitstatus_to_exitcode(status)}")
    return {"seconds": round(wall, 3), "peak_mb": round(usage.ru_maxrss / 1024, 1)}


def plain_read(run_dir: Path) -> float:
    """Seconds to read the timeline with a plain ``json.loads`` loop: the floor of a reading
    of every line."""
    started = time.perf_counter()
    with (run_dir / "events.jsonl").open("rb") as f:
        for line in f:
            json.loads(line)
    return round(time.perf_counter() - started, 3)


def bench(run_dir: Path, report: bool) -> dict[str, Any]:
    planaria = str(Path(sys.executable).parent / "planaria")
    figures: dict[str, Any] = {"mb": round((run_dir / "events.jsonl").stat().st_size / 1e6, 1)}
    figures["status"] = measure(planaria, "status", str(run_dir))
    started = time.perf_counter()
    status.view(run_dir)
    figures["status"]["in_process_s"] = round(time.perf_counter() - started, 3)
    figures["plain_read_s"] = plain_read(run_dir)
    if report:
        figures["report"] = measure(
            planaria, "report", str(run_dir), "-o", str(run_dir / "report.html")
        )
        figures["report"]["page_kb"] = round((run_dir / "report.html").stat().st_size / 1e3, 1)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=float, default=1000.0, help="timeline MB")
    parser.add_argument("--baseline", type=float, default=10.0, help="baseline timeline MB")
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--no-report", action="store_true", help="status only")
    parser.add_argument("--where", type=Path, default=None, help="where to write the runs")
    args = parser.parse_args()
    where = Path(tempfile.mkdtemp(prefix="events-scale-", dir=args.where))
    try:
        result: dict[str, Any] = {}
        for name, size in (("baseline", args.baseline), ("large", args.size)):
            started = time.perf_counter()
            lines = write_run(where / name, size, args.nodes, args.faults)
            made = time.perf_counter() - started
            result[name] = bench(where / name, not args.no_report)
            result[name]["lines"] = lines
            print(f"{name}: {lines} lines written in {made:.1f}s: {result[name]}", flush=True)
            shutil.rmtree(where / name)
        if "report" in result["large"]:
            took = result["large"]["report"]["seconds"] / result["large"]["plain_read_s"]
            result["report_vs_plain_read"] = round(took, 2)
        for command in ("status", "report"):
            if command in result["large"]:
                big, small = result["large"][command], result["baseline"][command]
                result[f"{command}_time_ratio"] = round(big["seconds"] / small["seconds"], 2)
                result[f"{command}_memory_ratio"] = round(big["peak_mb"] / small["peak_mb"], 2)
        result["self_peak_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        print(json.dumps(result))
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
