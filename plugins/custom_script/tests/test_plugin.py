"""The plugin as planaria sees it: found through its entry point, run by the real runner."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

from custom_script_helpers import MakeScript, read_pids, wait_dead

from planaria.health.api import CheckContext, HealthCheckRecord, Status
from planaria.health.host import HostCheck, HostOptions
from planaria.health.runner import ConfiguredCheck, run_checks
from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginKind
from planaria_custom_script import CustomScriptCheck, CustomScriptOptions, plugin


def test_entry_point_is_installed() -> None:
    found = [ep for ep in entry_points(group="planaria") if ep.name == "custom_script"]
    assert len(found) == 1
    assert found[0].value == "planaria_custom_script.plugin"
    assert found[0].dist is not None and found[0].dist.name == "planaria-custom-script"
    assert found[0].load() is plugin


def test_plugin_manager_resolves_the_record() -> None:
    manager = PluginManager.from_entry_points()
    record = manager.resolve(PluginKind.HEALTH_CHECK, "custom-script")
    assert isinstance(record, HealthCheckRecord)
    assert record.factory is CustomScriptCheck
    assert record.options is CustomScriptOptions
    assert record.summary.startswith("any chip:")
    assert manager.provider(PluginKind.HEALTH_CHECK, "custom_script").distribution == (
        "planaria-custom-script"
    )


def test_a_failing_script_does_not_hide_the_host_check(
    make_script: MakeScript, context: CheckContext
) -> None:
    (script_record,) = plugin.planaria_health_checks()
    host_record = HealthCheckRecord(name="host", factory=HostCheck, options=HostOptions)
    host_options = HostOptions(min_free_disk=1, min_shm=1, min_available_memory=1)
    script = make_script("echo 'driver crashed' >&2; exit 3")
    health = run_checks(
        [
            ConfiguredCheck("host", host_record, host_options, timeout=10),
            ConfiguredCheck("custom_script", script_record, CustomScriptOptions(path=script), 10),
        ],
        context,
    )
    host, custom = health.checks
    assert (host.check, custom.check) == ("host", "custom_script")
    assert host.status is Status.OK and host.devices
    assert custom.status is Status.ERROR
    assert custom.error is not None and "exited with code 3" in custom.error
    assert "driver crashed" in custom.error
    assert not health.healthy


def test_runner_timeout_cancels_and_kills_the_script(
    make_script: MakeScript, context: CheckContext, tmp_path: Path
) -> None:
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    script = make_script('sleep 1000 &\necho $! > "$PIDS/child"\necho $$ > "$PIDS/leader"\nwait')
    (record,) = plugin.planaria_health_checks()
    options = CustomScriptOptions(path=script, timeout=60, env={"PIDS": str(pids_dir)})
    health = run_checks([ConfiguredCheck("custom_script", record, options, timeout=0.5)], context)
    (result,) = health.checks
    assert result.status is Status.ERROR
    assert wait_dead(read_pids(pids_dir, count=2).values()) == []
