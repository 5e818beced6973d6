"""A plugin written outside planaria, once pip-installed, is listed and run by planaria.

The distribution under ``examples/outside-plugin`` is built and installed for real (``pip
install --target``) once per module; the real ``planaria`` command then runs in a subprocess
that sees it through ``PYTHONPATH``, exactly as it would see any package installed in
site-packages, and so do the plugin's own tests, which run the health-check conformance suite.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from planaria.health.api import CheckContext, HealthCheckRecord, Status
from planaria.health.runner import ConfiguredCheck, run_checks
from support.pytest_runs import run_pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "outside-plugin"
DISTRIBUTION = "planaria-example-loadavg"
DISABLE_ENV = "PLANARIA_DISABLE_PLUGINS"

# The host check runs beside loadavg; its thresholds are relaxed so that a small CI container
# (64 MiB /dev/shm, little free disk) does not decide these tests.
HOST = {
    "backend": "host",
    "options": {"min_free_disk": "1MiB", "min_shm": "1MiB", "min_available_memory": "1MiB"},
}


def _planaria_command() -> str:
    beside = Path(sys.executable).parent / "planaria"
    if beside.exists():
        return str(beside)
    found = shutil.which("planaria")
    if found is None:
        pytest.fail("the planaria console script is not installed (pip install -e .)")
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build and install the example distribution into a private directory, once."""
    root = tmp_path_factory.mktemp("external-plugin")
    source = root / "src"
    shutil.copytree(
        EXAMPLE,
        source,
        ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__"),
    )
    target = root / "site"
    command = [
        sys.executable, "-m", "pip", "install",
        "--no-deps", "--no-build-isolation", "--no-index", "--no-cache-dir",
        "--disable-pip-version-check", "--quiet",
        "--target", str(target), str(source),
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        pytest.fail(
            f"pip could not build and install {EXAMPLE} (exit {proc.returncode}); the build "
            "needs setuptools>=68 and wheel in this environment (pip install -e '.[test]'):\n"
            f"{proc.stdout}\n{proc.stderr}"
        )
    assert (target / "planaria_example_loadavg" / "plugin.py").is_file()
    return target


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


def _env(site: Path | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (DISABLE_ENV, "PYTHONPATH")}
    pythonpath = os.environ.get("PYTHONPATH")
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), pythonpath) if p)
    elif pythonpath:
        env["PYTHONPATH"] = pythonpath
    env.update(extra)
    return env


def planaria(
    *args: str, site: Path | None, cwd: Path, **extra_env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_planaria_command(), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=_env(site, **extra_env),
        timeout=120,
        check=False,
    )


def write_config(directory: Path, *checks: Any) -> Path:
    path = directory / "cfg.yaml"
    path.write_text(yaml.safe_dump({"diagnosis": {"checks": list(checks)}}, sort_keys=False))
    return path


def loadavg(**options: Any) -> dict[str, Any]:
    return {"backend": "loadavg", "options": options}


def by_name(items: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    return {item[key]: item for item in items}


def require_nonzero_load() -> None:
    """The tiny-threshold tests need a load above zero, as it is right after a pip build."""
    if not hasattr(os, "getloadavg"):
        pytest.skip("os.getloadavg is not available on this platform")
    if os.getloadavg()[0] == 0.0:
        pytest.skip("the 1-minute load average is exactly 0 on this machine")


# -- (a) listed ------------------------------------------------------------------------------


def test_plugins_lists_the_installed_distribution(site: Path, workdir: Path) -> None:
    proc = planaria("plugins", "--json", site=site, cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    plugins = by_name(json.loads(proc.stdout), "name")

    assert plugins["host"]["status"] == "loaded"
    example = plugins["loadavg"]
    assert example["distribution"] == DISTRIBUTION
    assert example["version"] == "0.1.0"
    assert example["status"] == "loaded"
    assert example["kinds"] == ["health_check"]
    assert example["records"] == [
        {
            "kind": "health_check",
            "name": "loadavg",
            "summary": "CPU load average per CPU, against degraded and failed thresholds",
        }
    ]


def test_config_schema_includes_the_plugin_options(site: Path, workdir: Path) -> None:
    proc = planaria("config", "schema", site=site, cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    schema = json.loads(proc.stdout)
    assert "loadavg" in schema["$defs"]["CheckSection"]["properties"]["backend"]["examples"]
    options = schema["$defs"]["planaria_example_loadavg.plugin.LoadavgOptions"]
    assert options["additionalProperties"] is False
    assert set(options["properties"]) == {"max_load_per_cpu", "degraded_load_per_cpu"}


# -- (b), (c) run ----------------------------------------------------------------------------


def test_check_runs_the_plugin_beside_host(site: Path, workdir: Path) -> None:
    config = write_config(workdir, HOST, loadavg(max_load_per_cpu=1000, degraded_load_per_cpu=1000))
    proc = planaria("check", "-c", str(config), "--json", site=site, cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    report = json.loads(proc.stdout)
    assert report["healthy"] is True
    checks = by_name(report["checks"], "check")
    assert list(checks) == ["host", "loadavg"]
    result = checks["loadavg"]
    assert result["status"] == "ok"
    assert result["error"] is None
    [cpu] = result["devices"]
    assert cpu["device"] == "cpu"
    assert cpu["status"] == "ok"
    assert "per CPU" in cpu["detail"]
    assert set(cpu["metrics"]) == {"load_1m", "load_5m", "load_15m", "cpus", "load_per_cpu"}
    assert cpu["metrics"]["cpus"] == os.cpu_count()


def test_check_fails_above_the_maximum_and_still_reports_host(site: Path, workdir: Path) -> None:
    require_nonzero_load()
    config = write_config(workdir, HOST, loadavg(max_load_per_cpu=1e-9, degraded_load_per_cpu=1e-9))
    proc = planaria("check", "-c", str(config), "--json", site=site, cwd=workdir)
    assert proc.returncode == 1, proc.stdout + proc.stderr

    report = json.loads(proc.stdout)
    assert report["healthy"] is False
    checks = by_name(report["checks"], "check")
    assert checks["loadavg"]["status"] == "failed"
    assert checks["loadavg"]["devices"][0]["device"] == "cpu"
    assert "above the maximum" in checks["loadavg"]["devices"][0]["detail"]
    assert checks["host"]["status"] == "ok"
    assert checks["host"]["devices"]


def test_check_degraded_is_still_healthy(site: Path, workdir: Path) -> None:
    require_nonzero_load()
    config = write_config(workdir, loadavg(max_load_per_cpu=1000, degraded_load_per_cpu=1e-9))
    proc = planaria("check", "-c", str(config), "--json", site=site, cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["healthy"] is True
    assert report["checks"][0]["status"] == "degraded"


def test_check_table_output_shows_the_plugin(site: Path, workdir: Path) -> None:
    config = write_config(workdir, loadavg(max_load_per_cpu=1000, degraded_load_per_cpu=1000))
    proc = planaria("check", "-c", str(config), site=site, cwd=workdir, COLUMNS="200")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loadavg" in proc.stdout
    assert "healthy" in proc.stdout


# -- (d), (e) config errors ------------------------------------------------------------------


def test_not_installed_lists_the_installed_choices(site: Path, workdir: Path) -> None:
    config = write_config(workdir, "host", loadavg(max_load_per_cpu=1000))
    proc = planaria("config", "validate", str(config), site=None, cwd=workdir)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "diagnosis.checks[1].backend" in proc.stderr
    assert "health check 'loadavg' is not installed" in proc.stderr
    assert "Choose one of:" in proc.stderr
    assert "host" in proc.stderr.split("Choose one of:")[1]


def test_bad_option_names_its_config_path(site: Path, workdir: Path) -> None:
    config = write_config(workdir, "host", loadavg(max_load_per_cpu="high"))
    proc = planaria("config", "validate", str(config), site=site, cwd=workdir)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "diagnosis.checks[1].options.max_load_per_cpu" in proc.stderr
    assert "valid number" in proc.stderr


def test_unknown_option_is_rejected(site: Path, workdir: Path) -> None:
    config = write_config(workdir, loadavg(max_load_per_cpu=8, max_load=8))
    proc = planaria("config", "validate", str(config), site=site, cwd=workdir)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "diagnosis.checks[0].options.max_load" in proc.stderr
    assert "max_load_per_cpu, degraded_load_per_cpu" in proc.stderr


def test_thresholds_out_of_order_are_rejected(site: Path, workdir: Path) -> None:
    config = write_config(workdir, loadavg(max_load_per_cpu=1, degraded_load_per_cpu=5))
    proc = planaria("config", "validate", str(config), site=site, cwd=workdir)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "diagnosis.checks[0].options" in proc.stderr
    assert "degraded_load_per_cpu (5) must not be greater than max_load_per_cpu (1)" in (
        proc.stderr
    )


def test_shipped_example_config_validates(site: Path, workdir: Path) -> None:
    # The config quoted in the example's README and in docs/writing-a-plugin.md.
    proc = planaria("config", "validate", str(EXAMPLE / "loadavg.yaml"), site=site, cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "health checks: host, loadavg" in " ".join(proc.stdout.split())


def test_valid_config_validates(site: Path, workdir: Path) -> None:
    config = write_config(workdir, "host", loadavg(max_load_per_cpu=8, degraded_load_per_cpu=4))
    proc = planaria("config", "validate", str(config), site=site, cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "health checks: host, loadavg" in " ".join(proc.stdout.split())


# -- (f) disabled ----------------------------------------------------------------------------


def test_disabled_plugin_is_blocked_and_cannot_be_selected(site: Path, workdir: Path) -> None:
    proc = planaria("plugins", "--json", site=site, cwd=workdir, **{DISABLE_ENV: "loadavg"})
    assert proc.returncode == 0, proc.stderr
    example = by_name(json.loads(proc.stdout), "name")["loadavg"]
    assert example["distribution"] == DISTRIBUTION
    assert example["status"] == "blocked"
    assert DISABLE_ENV in example["reason"]
    assert example["records"] == []

    config = write_config(workdir, "host", loadavg(max_load_per_cpu=1000))
    proc = planaria(
        "check", "-c", str(config), "--json", site=site, cwd=workdir, **{DISABLE_ENV: "loadavg"}
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "diagnosis.checks[1].backend" in proc.stderr
    assert "is disabled" in proc.stderr
    assert DISTRIBUTION in proc.stderr


def test_disabling_by_distribution_name(site: Path, workdir: Path) -> None:
    proc = planaria("plugins", "--json", site=site, cwd=workdir, **{DISABLE_ENV: DISTRIBUTION})
    assert proc.returncode == 0, proc.stderr
    assert by_name(json.loads(proc.stdout), "name")["loadavg"]["status"] == "blocked"


# -- (g) the plugin's own tests: the conformance suite -------------------------------------


def test_the_installed_plugin_passes_the_health_check_conformance_suite(
    site: Path, tmp_path: Path
) -> None:
    """The example's tests, run by pytest as its author would run them, against the installed
    distribution: every case of the suite passes, and only the one it declares absent skips."""
    project = tmp_path / "project"
    shutil.copytree(EXAMPLE / "tests", project / "tests")
    shutil.copy(EXAMPLE / "pyproject.toml", project)
    run = run_pytest(project / "tests", _env(site), project, "-q")
    assert run.returncode == 0, run.output
    assert not run.named("failed") and not run.named("error"), run.output
    skipped = run.bare("skipped") - {
        "test_unhealthy_with_reasons",
        "test_degraded_with_reasons",
        "test_devices_and_metrics",
    }
    assert skipped == {"test_its_own_hang_ends_when_cancelled"}, run.messages
    assert {
        "test_record",
        "test_options_forbid_unknown_keys",
        "test_healthy",
        "test_not_applicable_is_said_not_raised",
        "test_undecidable_is_an_error_with_the_check_s_message",
        "test_a_raising_check_is_an_error_and_hides_no_other",
        "test_a_hanging_check_is_cancelled_within_its_timeout",
    } <= run.bare("passed"), run.output


def test_the_plugin_imports_only_what_planaria_offers_plugin_authors() -> None:
    imports = [
        line.split()[1]
        for path in sorted(EXAMPLE.rglob("*.py"))
        for line in path.read_text().splitlines()
        if line.startswith(("from planaria", "import planaria"))
    ]
    assert imports, "the example imports nothing from planaria"
    assert set(imports) <= {"planaria.plugin", "planaria.testing"}, imports


# -- the check's own branches, in process ----------------------------------------------------


@pytest.fixture
def example_module(site: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(site))
    import planaria_example_loadavg.plugin as module

    return module


def _run(module: Any, **options: Any) -> Any:
    [record] = list(module.planaria_health_checks())
    assert isinstance(record, HealthCheckRecord)
    check = ConfiguredCheck("loadavg", record, record.options(**options), timeout=10.0)
    return run_checks([check], CheckContext(node="test", workdir=Path.cwd())).checks[0]


def test_not_applicable_without_getloadavg(
    example_module: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(os, "getloadavg", raising=False)
    result = _run(example_module)
    assert result.status is Status.NOT_APPLICABLE
    assert result.devices[0].device == "cpu"
    assert "not available" in result.devices[0].detail


def test_unknown_cpu_count_is_an_error(
    example_module: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 1.0, 1.0), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    result = _run(example_module)
    assert result.status is Status.ERROR
    assert result.error == "cannot tell how many CPUs this node has"


@pytest.mark.parametrize(
    ("load", "status"),
    [(1.0, Status.OK), (9.0, Status.DEGRADED), (17.0, Status.FAILED)],
)
def test_thresholds(
    example_module: Any, monkeypatch: pytest.MonkeyPatch, load: float, status: Status
) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.5, 0.25), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    result = _run(example_module)  # defaults: degraded above 2.0, failed above 4.0 per CPU
    assert result.status is status
    assert result.devices[0].metrics["load_per_cpu"] == load / 4
