"""The plugin as planaria sees it: its entry point, its options, and the real CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from pydantic import ValidationError

from planaria.health.api import HealthCheckRecord
from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginKind
from planaria.testing import FaultPatternConformance, assert_classifies, assert_unclassified
from planaria_ascend import AscendCheck, AscendOptions, plugin


def test_entry_point_is_installed() -> None:
    found = [ep for ep in entry_points(group="planaria") if ep.name == "ascend"]
    assert len(found) == 1
    assert found[0].dist is not None and found[0].dist.name == "planaria-ascend"
    assert found[0].load() is plugin


def test_plugin_manager_resolves_the_record() -> None:
    record = PluginManager.from_entry_points().resolve(PluginKind.HEALTH_CHECK, "ascend")
    assert isinstance(record, HealthCheckRecord)
    assert record.factory is AscendCheck
    assert record.options is AscendOptions


def test_options() -> None:
    assert AscendOptions(command_timeout="2m").command_timeout == 120.0
    with pytest.raises(ValidationError, match="npu_smi_path"):
        AscendOptions.model_validate({"npu_smi_path": "/usr/local/bin/npu-smi"})
    with pytest.raises(ValidationError, match="npu_smi must name an executable"):
        AscendOptions(npu_smi=" ")
    with pytest.raises(ValidationError, match="invalid duration"):
        AscendOptions.model_validate({"command_timeout": "soon"})


def _planaria() -> str:
    candidate = Path(sys.executable).parent / "planaria"
    found = str(candidate) if candidate.exists() else shutil.which("planaria")
    assert found, "the planaria console script is not installed"
    return found


CONFIG = """\
diagnosis:
  checks:
    - backend: host
      options: {min_free_disk: 1MiB, min_shm: 1MiB, min_available_memory: 1MiB}
    - backend: ascend
      options: {expected_devices: 8}
"""


def test_planaria_check_says_not_applicable(tmp_path: Path) -> None:
    """On this machine (no npu-smi, no torch_npu) ``planaria check`` reports the check as not
    applicable and exits 0: only a failed check or one that could not run exits 1."""
    if shutil.which("npu-smi", path=os.environ.get("PATH")):
        pytest.skip("this machine has npu-smi")
    config = tmp_path / "job.yaml"
    config.write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if k != "PLANARIA_DISABLE_PLUGINS"}
    env["COLUMNS"] = "250"
    run = [_planaria(), "check", "-c", str(config)]
    result = subprocess.run(
        [*run, "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    checks = {c["check"]: c for c in report["checks"]}
    assert list(checks) == ["host", "ascend"]
    assert checks["host"]["status"] == "ok"
    assert checks["ascend"]["status"] == "not_applicable"
    (device,) = checks["ascend"]["devices"]
    assert device["detail"].startswith("no Ascend NPU software on this node: npu-smi is not found")
    assert device["detail"].endswith("and torch_npu is not installed")
    assert report["healthy"] is True

    table = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    assert "not_applicable" in table.stdout
    assert "no Ascend NPU software on this node" in table.stdout
    assert "healthy (2 check(s))" in table.stdout


def test_hccl_errors_are_transient() -> None:
    line = "RuntimeError: HCCL function error: hcclAllReduce(...), error code is 7"
    assert_classifies(plugin.planaria_fault_patterns(), line, "transient", "HCCL")
    assert_unclassified(plugin.planaria_fault_patterns(), "HCCL_CONNECT_TIMEOUT=1800")


class TestAscendPatterns(FaultPatternConformance):
    plugin_name = "ascend"
    samples = [
        ("RuntimeError: HCCL function error: hcclAllReduce(...), error code is 7", "transient"),
    ]
    ordinary_lines = [
        "HCCL_CONNECT_TIMEOUT=1800",
        "export HCCL_EXEC_TIMEOUT=1800",
        # A training script's config, printed at start: settings, not a failure.
        "distributed: {backend: hccl, timeout: 1800, init_method: env://}",
    ]
