"""The plugin as planaria sees it: its entry point, `planaria plugins`, and a job config that
selects it, checked by the real `planaria config validate` command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginKind
from planaria.storage.api import CheckpointStorageRecord
from planaria_fsspec import FsspecStorage, FsspecStorageOptions, plugin

Cli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    """Run the installed ``planaria`` command in ``tmp_path``."""
    candidate = Path(sys.executable).parent / "planaria"
    executable = str(candidate) if candidate.exists() else shutil.which("planaria")
    assert executable, "the planaria console script is not installed"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "PLANARIA_DISABLE_PLUGINS"}
        env["COLUMNS"] = "200"
        return subprocess.run(
            [executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )

    return run


def test_entry_point_is_installed() -> None:
    found = [ep for ep in entry_points(group="planaria") if ep.name == "fsspec"]
    assert len(found) == 1
    assert found[0].value == "planaria_fsspec.plugin"
    assert found[0].dist is not None and found[0].dist.name == "planaria-fsspec"
    assert found[0].load() is plugin


def test_plugin_manager_resolves_the_record() -> None:
    manager = PluginManager.from_entry_points()
    record = manager.resolve(PluginKind.CHECKPOINT_STORAGE, "fsspec")
    assert isinstance(record, CheckpointStorageRecord)
    assert record.factory is FsspecStorage
    assert record.options is FsspecStorageOptions
    assert manager.provider(PluginKind.CHECKPOINT_STORAGE, "fsspec").distribution == (
        "planaria-fsspec"
    )


def test_planaria_plugins_lists_it(cli: Cli) -> None:
    result = cli("plugins", "--json")
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)}
    fsspec = plugins["fsspec"]
    assert fsspec["distribution"] == "planaria-fsspec"
    assert fsspec["status"] == "loaded"
    assert fsspec["kinds"] == ["checkpoint_storage"]
    assert [r["name"] for r in fsspec["records"]] == ["fsspec"]
    table = cli("plugins")
    assert table.returncode == 0 and "planaria-fsspec" in table.stdout


def test_config_validate_accepts_an_fsspec_storage(cli: Cli, tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(
        "job: {name: s3-run}\n"
        "checkpoint:\n"
        "  storage:\n"
        "    backend: fsspec\n"
        "    options:\n"
        "      url: s3://bucket/run\n"
        "      storage_options: {endpoint_url: 'http://127.0.0.1:9000'}\n"
        "      retries: 3\n"
        "      retry_backoff: 250ms\n"
    )
    result = cli("config", "validate", str(config))
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout
    shown = cli("config", "show", "--json", str(config))
    assert shown.returncode == 0, shown.stderr
    storage = json.loads(shown.stdout)["checkpoint"]["storage"]
    assert storage["backend"] == "fsspec"
    assert storage["options"]["url"] == "s3://bucket/run"
    assert storage["options"]["retries"] == 3
    assert storage["options"]["part_size"] == 16 << 20


def test_config_validate_names_each_bad_option(cli: Cli, tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(
        "checkpoint:\n"
        "  storage:\n"
        "    backend: fsspec\n"
        "    options:\n"
        "      url: bucket/run\n"
        "      retrys: 3\n"
    )
    result = cli("config", "validate", str(config))
    assert result.returncode == 2, result.stdout
    assert "2 problems" in result.stderr
    assert "checkpoint.storage.options.url" in result.stderr
    assert "has no protocol" in result.stderr
    assert "checkpoint.storage.options.retrys" in result.stderr
    assert "Traceback" not in result.stderr
