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
from real_nvml import DRIVER

from planaria.health.api import HealthCheckRecord
from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginKind
from planaria_nvidia import NvidiaCheck, NvidiaOptions, plugin


def test_entry_point_is_installed() -> None:
    found = [ep for ep in entry_points(group="planaria") if ep.name == "nvidia"]
    assert len(found) == 1
    assert found[0].dist is not None and found[0].dist.name == "planaria-nvidia"
    assert found[0].load() is plugin


def test_plugin_manager_resolves_the_record() -> None:
    manager = PluginManager.from_entry_points()
    record = manager.resolve(PluginKind.HEALTH_CHECK, "nvidia")
    assert isinstance(record, HealthCheckRecord)
    assert record.factory is NvidiaCheck
    assert record.options is NvidiaOptions


def test_options_defaults_and_errors() -> None:
    options = NvidiaOptions()
    assert options.fatal_xids == [48, 63, 64, 74, 79, 94, 95, 119, 120]
    assert options.expected_devices is None
    with pytest.raises(ValidationError, match="max_temprature"):
        NvidiaOptions.model_validate({"max_temprature": 80})
    with pytest.raises(ValidationError, match="XID 79 is listed in both"):
        NvidiaOptions(fatal_xids=[79], degraded_xids=[79])
    with pytest.raises(ValidationError, match="expected_devices"):
        NvidiaOptions(expected_devices=0)
    with pytest.raises(ValidationError, match="throttle_reasons"):
        NvidiaOptions.model_validate({"throttle_reasons": ["hot"]})
    assert NvidiaOptions(max_foreign_memory="2GiB").max_foreign_memory == 2 << 30


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
    - backend: nvidia
      options: {expected_devices: 8, max_temperature: 90}
"""


@pytest.mark.skipif(DRIVER, reason="this machine has an NVIDIA driver")
def test_planaria_check_says_not_applicable(tmp_path: Path) -> None:
    """``planaria check`` exits 0 when no check failed: not applicable is no failure."""
    config = tmp_path / "job.yaml"
    config.write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if k != "PLANARIA_DISABLE_PLUGINS"}
    env["COLUMNS"] = "200"
    run = [_planaria(), "check", "-c", str(config)]
    result = subprocess.run(
        [*run, "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    checks = {c["check"]: c for c in report["checks"]}
    assert list(checks) == ["host", "nvidia"]
    assert checks["host"]["status"] == "ok"
    assert checks["nvidia"]["status"] == "not_applicable"
    (device,) = checks["nvidia"]["devices"]
    assert device["detail"] == (
        "no NVIDIA driver on this node: NVML cannot start (NVML Shared Library Not Found)"
    )
    assert report["healthy"] is True

    table = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    assert "not_applicable" in table.stdout
    assert "no NVIDIA driver on this node" in table.stdout
    assert "healthy (2 check(s))" in table.stdout
