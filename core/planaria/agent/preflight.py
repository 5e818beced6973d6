"""The agent's side of the pre-flight node check: ask the master, run the benchmark, report.

Each run is a child process (:mod:`planaria.node_benchmark.child`) with the benchmark's
timeout: a benchmark that hangs (a wedged device, a peer that never comes) is killed and
reported as a timeout; one that raises is reported with the last line of its error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from planaria.agent.client import MasterClient
from planaria.chaos import ChaosRule
from planaria.diagnosis.messages import (
    BenchmarkRun,
    PreflightOrder,
    PreflightPoll,
    PreflightResult,
    PreflightTask,
)
from planaria.diagnosis.preflight import STOPPED
from planaria.log import get_logger
from planaria.node_benchmark.child import MARKER
from planaria.protocol import Ack

log = get_logger("agent.preflight")

ERROR_CHARS = 2000


async def preflight(
    client: MasterClient,
    node_id: str,
    host: str,
    addr: str,
    free_port: Callable[[str], int],
    chaos: Sequence[ChaosRule],
) -> bool:
    """Take part in the pre-flight check until the master says ``done`` (True) or ``exit``."""
    while True:
        poll = PreflightPoll(node_id=node_id, addr=addr, port=free_port(addr))
        order = await client.call("/preflight/next", poll, PreflightOrder)
        if order.state == "done":
            return True
        if order.state == "exit":
            log.info("pre-flight: told to leave", reason=order.reason)
            return False
        if order.state == "run" and order.task is not None:
            watch = PreflightPoll(
                node_id=node_id, addr=addr, port=poll.port, running=order.task.group
            )
            aborted = asyncio.ensure_future(_until_aborted(client, watch))
            try:
                result = await run_benchmark(node_id, host, order.task, chaos, aborted)
            finally:
                aborted.cancel()
            log.info(
                "pre-flight benchmark done",
                group=order.task.group,
                status=result.status,
                measures=result.measures,
                error=result.error or None,
            )
            await client.call("/preflight/result", result, Ack)


async def _until_aborted(client: MasterClient, watch: PreflightPoll) -> str:
    """Long-poll the master while the benchmark runs; return why, once it says ``abort``."""
    while True:
        order = await client.call("/preflight/next", watch, PreflightOrder)
        if order.state in ("abort", "exit"):
            return order.reason or order.state


def _chaos_for(node_id: str, chaos: Sequence[ChaosRule]) -> tuple[float, str | None]:
    slow, fail = 1.0, None
    for rule in chaos:
        if rule.node != node_id:
            continue
        if rule.kind == "slow_node" and rule.factor is not None:
            slow = max(slow, rule.factor)
        elif rule.kind == "fail_node":
            fail = rule.how or "raise"
    return slow, fail


async def run_benchmark(
    node_id: str,
    host: str,
    task: PreflightTask,
    chaos: Sequence[ChaosRule],
    aborted: asyncio.Future[str] | None = None,
) -> PreflightResult:
    """Run the task's benchmark in a child process, within its timeout; stop it early when
    ``aborted`` completes (a peer of the group failed)."""
    slow, fail = _chaos_for(node_id, chaos)
    order = BenchmarkRun(node_id=node_id, host=host, task=task, slow_factor=slow, fail=fail)
    timeout = task.benchmark.timeout
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "planaria.node_benchmark.child",
        str(os.getpid()),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )

    def result(status: str, error: str = "", **fields: object) -> PreflightResult:
        return PreflightResult(
            node_id=node_id,
            group=task.group,
            status=status,
            error=error[-ERROR_CHARS:],
            seconds=round(time.monotonic() - started, 3),
            **fields,
        )

    talk = asyncio.ensure_future(proc.communicate(order.model_dump_json().encode()))
    try:
        deadline = time.monotonic() + timeout
        pending: set[asyncio.Future[Any]] = {talk} if aborted is None else {talk, aborted}
        while True:
            left = max(0.0, deadline - time.monotonic())
            done, _ = await asyncio.wait(pending, timeout=left, return_when="FIRST_COMPLETED")
            if talk in done:
                break
            if aborted is not None and aborted in done:
                pending.discard(aborted)
                if aborted.exception() is not None:
                    continue  # the master could not be asked: let the benchmark run its course
                why = f"{STOPPED} ({aborted.result()})"
            else:
                why = ""
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await talk
            if why:
                return result("failed", why)
            return result("timeout", f"the benchmark did not finish within {timeout:g}s")
        out, err = talk.result()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        talk.cancel()
        await proc.wait()
        raise
    for line in reversed(out.decode("utf-8", "replace").splitlines()):
        if line.startswith(MARKER):
            data = json.loads(line[len(MARKER) :])
            return result("ok", measures=data["measures"], info=data["info"])
    lines = [ln.strip() for ln in err.decode("utf-8", "replace").splitlines() if ln.strip()]
    why = lines[-1] if lines else f"no result (exit code {proc.returncode})"
    return result("failed", why)
