"""The conformance suite of node benchmarks (:class:`~planaria.node_benchmark.api.NodeBenchmark`
plugins, the pre-flight node check).

The benchmark runs the way an agent runs it: in a child process
(:mod:`planaria.node_benchmark.child`, through :func:`planaria.agent.preflight.run_benchmark`)
that finds it among the *installed* plugins, one process per node of a group formed on this
machine. So the plugin must be installed (``pip install -e .``) for its tests to run.

Subclass :class:`NodeBenchmarkConformance` in a test module (the class name must start with
``Test``), set ``benchmark_name`` to the installed name, and, when the defaults do not suit,
give a ``benchmark_options`` fixture (options as a config file gives them; keep the run short).

Example::

    class TestMyChipBenchmark(NodeBenchmarkConformance):
        benchmark_name = "mychip"

        @pytest.fixture
        def benchmark_options(self):
            return {"size": 512}
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
from pydantic import ValidationError

from planaria.agent.address import free_port
from planaria.agent.preflight import run_benchmark
from planaria.config import load
from planaria.diagnosis.messages import BenchmarkRun, BenchmarkSpec, PreflightResult, PreflightTask
from planaria.errors import ConfigError
from planaria.node_benchmark.api import BenchmarkResult, NodeBenchmark, NodeBenchmarkRecord
from planaria.node_benchmark.child import MARKER
from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginKind, normalize_name

NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
UNKNOWN_KEY = "planaria_conformance_no_such_option"
LOOPBACK = "127.0.0.1"


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct ports free on ``host`` a moment ago, picked as an agent picks its
    group's (below the ephemeral range: a port the kernel hands out for any connection on a
    busy machine may be taken again before the group binds it)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports


def group_task(
    backend: str, options: dict[str, Any], timeout: float, size: int, rank: int, port: int
) -> PreflightTask:
    """Rank ``rank``'s order in a group of ``size`` nodes led on this machine at ``port``."""
    return PreflightTask(
        group="conformance",
        stage="round 1",
        members=[f"node-{i}" for i in range(size)],
        rank=rank,
        master_addr=LOOPBACK,
        master_port=port,
        benchmark=BenchmarkSpec(backend=backend, options=options, timeout=timeout),
    )


def run_group(
    backend: str, options: dict[str, Any], timeout: float, size: int
) -> list[PreflightResult]:
    """Every node of a group of ``size``, each in its child process, as agents run them."""
    (port,) = free_ports(1)

    async def all_ranks() -> list[PreflightResult]:
        return await asyncio.gather(
            *(
                run_benchmark(
                    f"node-{rank}",
                    "localhost",
                    group_task(backend, options, timeout, size, rank, port),
                    chaos=[],
                )
                for rank in range(size)
            )
        )

    return asyncio.run(all_ranks())


class NodeBenchmarkConformance:
    """Tests every node benchmark must pass; see the module docstring."""

    benchmark_name: ClassVar[str | None] = None
    timeout: ClassVar[float] = 120.0
    """The benchmark's timeout (``diagnosis.preflight_timeout``) in the runs that must pass."""
    can_group: ClassVar[bool] = True
    """Groups of two nodes on this machine: false where the device allows one process only."""
    peer_timeout: ClassVar[float] = 5.0
    """The benchmark's timeout in the test where its peer never comes."""
    honours_timeout: ClassVar[bool] = True
    """The benchmark gives up by itself once its timeout passed (its collective's own timeout)."""
    startup_allowance: ClassVar[float] = 60.0
    """Start-up time (imports, a device's initialisation) not counted against the timeout."""

    # -- what the subclass provides ----------------------------------------------------------

    @pytest.fixture
    def benchmark_options(self) -> dict[str, Any]:
        return {}

    @pytest.fixture
    def record(self) -> NodeBenchmarkRecord:
        if self.benchmark_name is None:
            pytest.fail(
                "a NodeBenchmarkConformance subclass must set benchmark_name: the name its "
                "installed plugin registers (the child process finds it among the installed)"
            )
        found = PluginManager.from_entry_points().resolve(
            PluginKind.NODE_BENCHMARK, self.benchmark_name
        )
        assert isinstance(found, NodeBenchmarkRecord)
        return found

    # -- helpers -----------------------------------------------------------------------------

    def spec_options(self, record: NodeBenchmarkRecord, options: dict[str, Any]) -> dict[str, Any]:
        """The options as the master sends them: validated, defaults filled in."""
        dumped: dict[str, Any] = record.options.model_validate(options).model_dump(mode="json")
        return dumped

    def check_group(
        self, record: NodeBenchmarkRecord, options: dict[str, Any], size: int
    ) -> list[PreflightResult]:
        results = run_group(record.name, self.spec_options(record, options), self.timeout, size)
        for result in results:
            assert result.status == "ok", f"{result.node_id}: {result.status}: {result.error}"
            assert result.measures, f"{result.node_id}: a benchmark returns at least one measure"
            BenchmarkResult(measures=result.measures, info=result.info)
            for name, value in result.measures.items():
                assert NAME.match(name), f"measure name {name!r} is not lower-case snake case"
                assert math.isfinite(value) and value > 0, (
                    f"{result.node_id}: measure {name} = {value!r}; measures are durations in "
                    "seconds, above zero"
                )
            for name, info in result.info.items():
                assert NAME.match(name), f"info name {name!r} is not lower-case snake case"
                assert not isinstance(info, float) or math.isfinite(info), f"info {name} = {info}"
        return results

    # -- the record --------------------------------------------------------------------------

    def test_record(self, record: NodeBenchmarkRecord, benchmark_options: dict[str, Any]) -> None:
        assert record.name == normalize_name(record.name)
        assert isinstance(record.factory, type) and issubclass(record.factory, NodeBenchmark)
        assert record.summary and "\n" not in record.summary
        record.options.model_validate(benchmark_options)

    # -- runs --------------------------------------------------------------------------------

    def test_runs_alone_in_a_child_process(
        self, record: NodeBenchmarkRecord, benchmark_options: dict[str, Any]
    ) -> None:
        (result,) = self.check_group(record, benchmark_options, 1)
        assert result.seconds > 0

    def test_runs_in_a_group_of_two(
        self, record: NodeBenchmarkRecord, benchmark_options: dict[str, Any]
    ) -> None:
        if not self.can_group:
            pytest.skip("this benchmark cannot run two nodes on one machine")
        results = self.check_group(record, benchmark_options, 2)
        assert [set(r.measures) for r in results] == [set(results[0].measures)] * 2, (
            "every node of a group reports the same measures, so that they can be compared"
        )

    # -- failures ----------------------------------------------------------------------------

    def test_bad_options_are_a_config_error(
        self, record: NodeBenchmarkRecord, benchmark_options: dict[str, Any], tmp_path: Path
    ) -> None:
        with pytest.raises(ValidationError):
            record.options.model_validate({**benchmark_options, UNKNOWN_KEY: 1})
        config = tmp_path / "job.yaml"
        section = {"backend": record.name, "options": {**benchmark_options, UNKNOWN_KEY: 1}}
        config.write_text(json.dumps({"diagnosis": {"preflight_benchmark": section}}))
        with pytest.raises(ConfigError) as caught:
            load(config)
        assert f"diagnosis.preflight_benchmark.options.{UNKNOWN_KEY}" in str(caught.value)

    def test_bad_options_in_the_child_are_a_clear_failure(
        self, record: NodeBenchmarkRecord, benchmark_options: dict[str, Any]
    ) -> None:
        options = {**self.spec_options(record, benchmark_options), UNKNOWN_KEY: 1}
        (result,) = run_group(record.name, options, self.timeout, 1)
        assert result.status == "failed", result
        assert UNKNOWN_KEY in result.error and "\n" not in result.error, result.error

    def test_a_missing_peer_is_a_clear_failure_within_its_timeout(
        self, record: NodeBenchmarkRecord, benchmark_options: dict[str, Any]
    ) -> None:
        """The leader of a group of two whose peer never comes, and a member whose leader
        never comes: each must raise once its timeout passed, not wait to be killed."""
        if not self.honours_timeout:
            pytest.skip("this benchmark does not give up by itself: the agent's kill ends it")
        options = self.spec_options(record, benchmark_options)
        # Nobody listens at the member's leader port: it was free a moment ago.
        ports = free_ports(2)
        orders = [
            BenchmarkRun(
                node_id=f"node-{rank}",
                host="localhost",
                task=group_task(record.name, options, self.peer_timeout, 2, rank, ports[rank]),
            )
            for rank in (0, 1)
        ]
        children = [
            subprocess.Popen(
                [sys.executable, "-m", "planaria.node_benchmark.child", str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in orders
        ]
        allowed = 4 * self.peer_timeout + self.startup_allowance
        outcomes = []
        try:
            for child, order in zip(children, orders, strict=True):
                try:
                    out, err = child.communicate(order.model_dump_json(), timeout=allowed)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.communicate()
                    pytest.fail(
                        f"rank {order.task.rank} without its peer was still running "
                        f"{allowed:g}s after start with a timeout of {self.peer_timeout:g}s: "
                        "pass context.timeout to the collective library's own timeout"
                    )
                outcomes.append((order.task.rank, child.returncode, out, err))
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.communicate()
        for rank, code, out, err in outcomes:
            assert MARKER not in out, f"rank {rank} succeeded without its peer: {out}"
            assert code == 1, f"rank {rank} exited {code}: {err[-2000:]}"
            lines = [line for line in err.splitlines() if line.strip()]
            assert lines and not lines[-1].startswith((" ", "Traceback")), err[-2000:]
