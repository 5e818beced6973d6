"""The pre-flight node check in pieces: grouping and verdicts, chaos rules, the config, the
built-in ``cpu`` benchmark (real torch and gloo, one process) and its child process."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import pytest
from conftest import PLUGIN_FIXTURES
from pydantic import ValidationError

from planaria.chaos import ChaosRule
from planaria.config import load
from planaria.diagnosis.messages import BenchmarkRun, BenchmarkSpec, PreflightTask
from planaria.diagnosis.preflight import (
    STOPPED,
    Outcome,
    groups_of,
    judge,
    regroup,
    slowest,
    slowest_per_measure,
    suspects_of,
)
from planaria.errors import ConfigError
from planaria.node_benchmark.api import BenchmarkContext, NodeBenchmarkRecord
from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginKind
from planaria.process import running


def ok(node: str, ms: float) -> Outcome:
    return Outcome(node, "ok", {"matmul": ms / 1000})


def test_groups_are_pairs_with_one_of_three_when_odd():
    assert groups_of([]) == []
    assert groups_of(["a"]) == [["a"]]
    assert groups_of(["a", "b", "c", "d"]) == [["a", "b"], ["c", "d"]]
    assert groups_of(["a", "b", "c", "d", "e"]) == [["a", "b"], ["c", "d", "e"]]


def test_round_one_suspects_a_failed_group_and_a_slow_node_against_the_others_median():
    groups = [
        [ok("n0", 10), ok("n1", 60)],  # n1: 6x the others' median
        [Outcome("n2", "failed", error="boom"), Outcome("n3", "failed", error=STOPPED)],
        [ok("n4", 11), ok("n5", 9)],
    ]
    good, suspects = suspects_of(groups, factor=3.0)
    assert good == ["n0", "n4", "n5"]
    assert set(suspects) == {"n1", "n2", "n3"}
    assert suspects["n1"].startswith("slow: matmul 60.0 ms, 6.0x the other nodes' median (10.0 ms)")
    # The node that failed by itself is named; the one stopped because of it is not.
    assert suspects["n3"] == "its group failed (n2 failed: boom)"


def test_with_two_nodes_the_slow_one_is_measured_against_the_other_only():
    assert slowest(ok("a", 60), [ok("a", 60), ok("b", 10)], 3.0) is not None
    assert slowest(ok("b", 10), [ok("a", 60), ok("b", 10)], 3.0) is None
    assert slowest(ok("a", 60), [ok("a", 60)], 3.0) is None  # no yardstick: no verdict


def test_the_slowest_node_per_measure_among_those_that_completed():
    outcomes = [
        Outcome("n0", "ok", {"matmul": 0.010, "allreduce": 0.004}),
        Outcome("n1", "ok", {"matmul": 0.012, "allreduce": 0.003}),
        Outcome("n2", "timeout", {"matmul": 9.0}),  # no measure of a run that did not complete
    ]
    assert slowest_per_measure(outcomes) == {"allreduce": ("n0", 0.004), "matmul": ("n1", 0.012)}
    assert slowest_per_measure([]) == {}


def test_round_two_pairs_each_suspect_with_a_distinct_good_node_or_runs_it_alone():
    assert regroup(["s1", "s2", "s3"], ["g1", "g2"]) == [["g1", "s1"], ["g2", "s2"], ["s3"]]


def test_round_two_verdicts_tell_faulty_from_straggler_from_innocent():
    good = [ok("g1", 10), ok("g2", 12)]
    faulty = judge(Outcome("s", "timeout", error="no result"), good, 3.0, "its group failed", "g1")
    assert faulty.kind == "faulty" and "timeout: no result again, next to good node g1" in (
        faulty.detail
    )
    slow = judge(ok("s", 70), good, 3.0, "slow", None)
    assert (
        slow.kind == "straggler"
        and slow.slow is not None
        and slow.slow.ratio == pytest.approx(70 / 11)
    )
    assert "alone" in slow.detail
    assert judge(ok("s", 12), good, 3.0, "its group failed", "g2").kind == "cleared"
    newcomer = judge(Outcome("s", "failed", error="x"), good, 3.0, "newcomer", "g1")
    assert newcomer.detail == "failed: x, next to good node g1"


def test_preflight_chaos_rules_name_a_node_and_say_what_is_wrong():
    slow = ChaosRule.model_validate("slow_node node=node-3 factor=5")
    assert (slow.node, slow.factor, slow.in_preflight, slow.in_worker) == ("node-3", 5, True, False)
    fail = ChaosRule.model_validate("fail_node node=node-1 how=hang")
    assert fail.how == "hang"
    for text, message in [
        ("slow_node factor=5", "takes node"),
        ("slow_node node=node-1", "slow_node takes factor"),
        ("fail_node node=node-1 factor=2", "fail_node does not"),
        ("fail_node node=node-1 at_step=3", "it takes no at_step"),
        ("fail_node node=node-1 how=melt", "how"),
        ("kill_worker rank=1 at_step=2 node=node-1", "takes no node or how"),
    ]:
        with pytest.raises(ValidationError, match=message):
            ChaosRule.model_validate(text)


def test_the_cpu_benchmark_registers_through_the_entry_point_group():
    manager = PluginManager.from_entry_points()
    record = manager.resolve(PluginKind.NODE_BENCHMARK, "cpu")
    assert isinstance(record, NodeBenchmarkRecord) and record.summary
    assert manager.provider(PluginKind.NODE_BENCHMARK, "cpu").distribution == "planaria"


def test_the_config_selects_the_benchmark_and_reports_a_bad_one_where_it_is(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "diagnosis:\n  preflight: true\n  preflight_factor: 4\n"
        "  preflight_benchmark: {backend: cpu, options: {size: 64}}\n"
    )
    resolved, _ = load(path)
    backend = resolved.backends["diagnosis.preflight_benchmark"]
    assert backend.record.name == "cpu" and backend.options.size == 64  # type: ignore[attr-defined]
    for text, where, what in [
        ("diagnosis: {preflight_benchmark: nccl}", "diagnosis.preflight_benchmark.backend", "cpu"),
        (
            "diagnosis: {preflight_benchmark: {backend: cpu, options: {sise: 64}}}",
            "diagnosis.preflight_benchmark.options.sise",
            "",
        ),
        ("diagnosis: {preflight_factor: 1}", "diagnosis.preflight_factor", "greater than 1"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError) as exc:
            load(path)
        (issue,) = exc.value.issues
        assert issue.path == where and what in issue.message, str(issue)


def _context(slow: float = 1.0) -> BenchmarkContext:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return BenchmarkContext("node-0", "local-0", 0, 1, "127.0.0.1", port, 30.0, slow)


def test_the_cpu_benchmark_times_a_matmul_and_checks_an_allreduce():
    pytest.importorskip("torch")
    from planaria.node_benchmark.cpu import CpuBenchmark, CpuOptions

    bench = CpuBenchmark(CpuOptions(size=128, repeats=5))
    normal = bench.run(_context())
    assert set(normal.measures) == {"matmul"} and normal.measures["matmul"] > 0
    assert {"allreduce_s", "matmul_gflops", "group_init_s"} <= set(normal.info)
    slow = bench.run(_context(slow=5.0))
    # The injected slowness burns real CPU time inside the timed span.
    assert slow.measures["matmul"] > 3 * normal.measures["matmul"]


@pytest.mark.slow
def test_the_benchmark_child_reports_a_result_a_failure_and_a_timeout(tmp_path):
    pytest.importorskip("torch")
    from planaria.agent.preflight import run_benchmark

    ctx = _context()
    spec = BenchmarkSpec(backend="cpu", options={"size": 64}, timeout=30.0)
    task = PreflightTask(
        group="round1.1",
        stage="round 1",
        members=["node-0"],
        rank=0,
        master_addr=ctx.master_addr,
        master_port=ctx.master_port,
        benchmark=spec,
    )
    done = asyncio.run(run_benchmark("node-0", "local-0", task, []))
    assert done.status == "ok" and done.measures["matmul"] > 0, done

    raises = [ChaosRule.model_validate("fail_node node=node-0")]
    failed = asyncio.run(run_benchmark("node-0", "local-0", task, raises))
    assert failed.status == "failed"
    assert failed.error.startswith("planaria.chaos.InjectedFault: planaria chaos: fail_node")

    hangs = [ChaosRule.model_validate("fail_node node=node-0 how=hang")]
    short = task.model_copy(update={"benchmark": spec.model_copy(update={"timeout": 3.0})})
    hung = asyncio.run(run_benchmark("node-0", "local-0", short, hangs))
    assert hung.status == "timeout" and 3.0 <= hung.seconds < 10.0
    assert "did not finish within 3s" in hung.error


@pytest.mark.slow
def test_the_benchmark_child_has_the_agent_s_environment_and_no_group_variables(monkeypatch):
    # What the guide and BenchmarkContext say: the group is in the context only. The child's
    # environment is the agent's as it is, so a variable there says nothing of this group.
    from planaria.agent.preflight import run_benchmark

    fixture = str(PLUGIN_FIXTURES / "envbench")
    path = os.pathsep.join(filter(None, [fixture, os.getenv("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.delenv("PLANARIA_DISABLE_PLUGINS", raising=False)
    for name in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "an-outer-launcher's")
    task = PreflightTask(
        group="round1.1",
        stage="round 1",
        members=["node-0", "node-1"],
        rank=1,
        master_addr="10.0.0.7",
        master_port=29400,
        benchmark=BenchmarkSpec(backend="envbench", timeout=60.0),
    )
    result = asyncio.run(run_benchmark("node-1", "local-1", task, []))
    assert result.status == "ok", result
    assert result.info == {
        "MASTER_ADDR": "an-outer-launcher's",
        "MASTER_PORT": "unset",
        "RANK": "unset",
        "WORLD_SIZE": "unset",
        "LOCAL_RANK": "unset",
        "context": "10.0.0.7:29400 rank 1",
    }


@pytest.mark.slow
def test_the_benchmark_child_dies_with_its_agent(tmp_path):
    """A hung benchmark never outlives the agent that started it (PR_SET_PDEATHSIG)."""
    import subprocess
    import time

    task = PreflightTask(
        group="round1.1",
        stage="round 1",
        members=["node-0"],
        rank=0,
        master_addr="127.0.0.1",
        master_port=1,
        benchmark=BenchmarkSpec(backend="cpu", timeout=60.0),
    )
    order = BenchmarkRun(node_id="node-0", host="local-0", task=task, fail="hang")
    (tmp_path / "order.json").write_text(order.model_dump_json())
    script = tmp_path / "agent.py"
    script.write_text(  # the order is read to its end: only the death signal can stop the child
        "import os, subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-m', 'planaria.node_benchmark.child',"
        f" str(os.getpid())], stdin=open({str(tmp_path / 'order.json')!r}))\n"
        "print(child.pid, flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    agent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert agent.stdout is not None
    child = int(agent.stdout.readline())
    time.sleep(1.0)  # the child is in its hang by now
    assert running(child), "the child did not hang"
    agent.kill()
    agent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if not running(child):
            break
        time.sleep(0.05)
    else:
        os.kill(child, 9)
        pytest.fail("the benchmark child outlived its agent")
