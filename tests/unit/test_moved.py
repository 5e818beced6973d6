"""Public names that moved keep their old home for a minor version: a plugin written against it
still imports them, warned where each lives now."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

OLD_HOMES = [
    # (old module, name, new module)
    ("planaria.benchmark", "BenchmarkContext", "planaria.node_benchmark.api"),
    ("planaria.benchmark", "BenchmarkResult", "planaria.node_benchmark.api"),
    ("planaria.benchmark", "Clock", "planaria.node_benchmark.api"),
    ("planaria.benchmark", "NodeBenchmark", "planaria.node_benchmark.api"),
    ("planaria.checks.runner", "run_checks", "planaria.health.runner"),
    ("planaria.checks.runner", "ConfiguredCheck", "planaria.health.runner"),
    ("planaria.checks.host", "HostCheck", "planaria.health.host"),
    ("planaria.checks.host", "HostOptions", "planaria.health.host"),
    ("planaria.checks.host", "available_memory_bytes", "planaria.health.host"),
    ("planaria.health", "CheckContext", "planaria.health.api"),
    ("planaria.health", "CheckResult", "planaria.health.api"),
    ("planaria.health", "DeviceResult", "planaria.health.api"),
    ("planaria.health", "HealthCheck", "planaria.health.api"),
    ("planaria.health", "NodeHealth", "planaria.health.api"),
    ("planaria.health", "Status", "planaria.health.api"),
    ("planaria.scheduler", "LaunchSpec", "planaria.scheduler.api"),
    ("planaria.scheduler", "NodeEvent", "planaria.scheduler.api"),
    ("planaria.scheduler", "NodeHandle", "planaria.scheduler.api"),
    ("planaria.scheduler", "NodeState", "planaria.scheduler.api"),
    ("planaria.scheduler", "Scheduler", "planaria.scheduler.api"),
    ("planaria.storage", "CheckpointStorage", "planaria.storage.api"),
    ("planaria.storage", "split_key", "planaria.storage.api"),
    ("planaria.plugin.records", "HealthCheckRecord", "planaria.health.api"),
    ("planaria.plugin.records", "SchedulerRecord", "planaria.scheduler.api"),
    ("planaria.plugin.records", "CheckpointStorageRecord", "planaria.storage.api"),
    ("planaria.plugin.records", "NodeBenchmarkRecord", "planaria.node_benchmark.api"),
    ("planaria.diagnosis.classify", "match", "planaria.fault_pattern.api"),
    ("planaria.diagnosis.classify", "FaultKind", "planaria.fault_pattern.api"),
]


IDS = [f"{old}.{name}" for old, name, _ in OLD_HOMES]


@pytest.mark.parametrize(("old", "name", "new"), OLD_HOMES, ids=IDS)
def test_an_old_import_works_and_warns_naming_the_new_home(old: str, name: str, new: str) -> None:
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning) as caught:
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), name)
    (warning,) = caught
    message = str(warning.message)
    assert message.startswith(f"{old}.{name} moved to {new}: import it from "), message
    assert warning.filename == __file__  # it points at the import, not at planaria


def test_a_name_in_the_public_api_is_sent_there_and_an_internal_one_to_its_module() -> None:
    import planaria.benchmark as benchmark
    import planaria.checks.runner as runner

    with pytest.warns(DeprecationWarning, match="import it from planaria.plugin, its public home"):
        _ = benchmark.NodeBenchmark
    with pytest.warns(
        DeprecationWarning, match="moved to planaria.health.runner: import it from there"
    ):
        _ = runner.run_checks


def test_a_name_that_never_lived_there_is_no_attribute() -> None:
    import planaria.health

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match=r"'planaria\.health' has no attribute 'Nope'"):
            _ = planaria.health.Nope
        assert not hasattr(planaria.health, "HealthCheckRecord")  # it lived in plugin.records


def test_a_plugin_written_against_the_old_homes_imports_and_runs_its_check(tmp_path: Path) -> None:
    """The imports of a plugin and its test from before the kinds had their own packages, in a
    fresh interpreter with DeprecationWarning shown: every one works and warns."""
    script = tmp_path / "old_plugin.py"
    script.write_text(
        textwrap.dedent(
            """
            from pathlib import Path

            from planaria.benchmark import BenchmarkContext, BenchmarkResult, NodeBenchmark
            from planaria.checks.runner import ConfiguredCheck, run_checks
            from planaria.diagnosis.classify import FaultClass, match
            from planaria.health import CheckContext, DeviceResult, HealthCheck, Status
            from planaria.plugin.records import HealthCheckRecord, NodeBenchmarkRecord
            from planaria.scheduler import Scheduler
            from planaria.storage import CheckpointStorage

            class Fine(HealthCheck):
                def run(self):
                    return [DeviceResult(device="cpu", status=Status.OK, detail="fine")]

            record = HealthCheckRecord(name="fine", factory=Fine, summary="always fine")
            context = CheckContext(node="n", workdir=Path("."))
            check = ConfiguredCheck("fine", record, record.options(), 10.0)
            (result,) = run_checks([check], context).checks
            print("status", result.status.value)
            """
        )
    )
    run = subprocess.run(
        [sys.executable, "-W", "always::DeprecationWarning", str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "status ok"
    for old, new in [
        ("planaria.benchmark.NodeBenchmark", "planaria.node_benchmark.api"),
        ("planaria.checks.runner.run_checks", "planaria.health.runner"),
        ("planaria.diagnosis.classify.match", "planaria.fault_pattern.api"),
        ("planaria.health.CheckContext", "planaria.health.api"),
        ("planaria.plugin.records.HealthCheckRecord", "planaria.health.api"),
        ("planaria.scheduler.Scheduler", "planaria.scheduler.api"),
        ("planaria.storage.CheckpointStorage", "planaria.storage.api"),
    ]:
        assert f"DeprecationWarning: {old} moved to {new}" in run.stderr, run.stderr
