"""The child process in which an agent runs one pre-flight benchmark.

``python -m planaria.node_benchmark.child PARENT_PID`` reads a :class:`BenchmarkRun` on stdin,
binds the benchmark to this node's installed plugins, runs it and prints the result on one
stdout line that starts with :data:`MARKER`. A benchmark that raises exits 1 with its traceback
on stderr, then the error again on one last line: the agent reports that last line, which for a
message of several lines (an options model's validation error) would otherwise be a fragment.
The agent kills the process when it overruns its timeout; the process also dies with the agent
(``PR_SET_PDEATHSIG``), so a hung benchmark never outlives its node.
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any

from planaria import process
from planaria.chaos import InjectedFault
from planaria.diagnosis.messages import BenchmarkRun
from planaria.errors import PluginError
from planaria.node_benchmark.api import BenchmarkContext, BenchmarkResult, NodeBenchmark
from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginKind

MARKER = "planaria-benchmark-result "


def run(order: BenchmarkRun) -> str:
    task = order.task
    if order.fail is not None:
        message = f"planaria chaos: fail_node node={order.node_id} how={order.fail} ({task.stage})"
        print(message, file=sys.stderr, flush=True)
        if order.fail == "hang":  # as a wedged device would: never returns
            while True:
                time.sleep(3600)
        raise InjectedFault(message)
    spec = task.benchmark
    manager = PluginManager.from_entry_points(disable=spec.disable_plugins)
    benchmark: NodeBenchmark[Any] = manager.build(
        PluginKind.NODE_BENCHMARK,
        {"backend": spec.backend, "options": spec.options},
        path="diagnosis.preflight_benchmark",
    )
    context = BenchmarkContext(
        node_id=order.node_id,
        host=order.host,
        rank=task.rank,
        world_size=len(task.members),
        master_addr=task.master_addr,
        master_port=task.master_port,
        timeout=spec.timeout,
        slow_factor=order.slow_factor,
    )
    result = benchmark.run(context)
    if not isinstance(result, BenchmarkResult):
        raise PluginError(
            f"node benchmark {spec.backend!r} returned {type(result).__name__}, "
            "expected a BenchmarkResult"
        )
    return MARKER + result.model_dump_json()


def main(argv: list[str]) -> None:
    process.die_with(int(argv[0]))
    try:
        line = run(BenchmarkRun.model_validate_json(sys.stdin.read()))
    except Exception as exc:
        traceback.print_exc()
        print(one_line(exc), file=sys.stderr, flush=True)
        sys.exit(1)
    print(line, flush=True)


def one_line(exc: BaseException) -> str:
    """``module.Type: message`` on one line, as the last line of a traceback reads when the
    message is one line."""
    return " ".join("".join(traceback.format_exception_only(type(exc), exc)).split())


if __name__ == "__main__":
    main(sys.argv[1:])
