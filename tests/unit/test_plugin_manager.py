"""Real entry-point loading through committed fake distributions on sys.path."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

import planaria
from planaria.errors import (
    DuplicatePluginError,
    PluginError,
    PluginLoadError,
    PluginNotFoundError,
)
from planaria.events import JobEvent, NodeReplaced
from planaria.health.api import HealthCheck, HealthCheckRecord
from planaria.plugin.manager import PluginManager, PluginStatus
from planaria.plugin.records import NoOptions, PluginKind


def test_builtin_host_check_registers_through_the_entry_point_group(plugin_path):
    manager = PluginManager.from_entry_points()
    info = manager.plugins["host"]
    assert info.distribution == "planaria"
    assert info.version == planaria.__version__
    assert info.status is PluginStatus.LOADED
    assert "host" in manager.records(PluginKind.HEALTH_CHECK)
    assert manager.provider(PluginKind.HEALTH_CHECK, "host") is info


def test_third_party_plugin_loads_and_its_name_is_normalised(plugin_path):
    plugin_path("good")
    manager = PluginManager.from_entry_points()
    info = manager.plugins["tempdir"]
    assert (info.distribution, info.version, info.status) == (
        "planaria_fixture_good",
        "1.0",
        PluginStatus.LOADED,
    )
    record = manager.resolve(PluginKind.HEALTH_CHECK, "TEMP-DIR")
    assert record.name == "temp_dir"
    assert info.kinds == ["health_check"]


def test_import_failure_is_a_warning_and_the_others_still_load(plugin_path, capsys):
    plugin_path("broken", "good")
    manager = PluginManager.from_entry_points()
    broken = manager.plugins["brokencheck"]
    assert broken.status is PluginStatus.FAILED
    assert "planaria_vendor_library_that_is_not_installed" in broken.reason
    assert manager.plugins["tempdir"].status is PluginStatus.LOADED
    assert set(manager.records(PluginKind.HEALTH_CHECK)) >= {"host", "temp_dir"}


def test_selecting_a_plugin_that_failed_to_import_shows_the_import_failure(plugin_path):
    plugin_path("slurm")
    manager = PluginManager.from_entry_points()
    with pytest.raises(PluginLoadError) as exc:
        manager.resolve(PluginKind.SCHEDULER, "slurm")
    assert "failed to load" in str(exc.value)
    assert "libslurm.so.40" in str(exc.value)


def test_blocked_by_config_and_by_environment(plugin_path, monkeypatch):
    plugin_path("good")
    manager = PluginManager.from_entry_points(disable=["tempdir"])
    assert manager.plugins["tempdir"].status is PluginStatus.BLOCKED
    with pytest.raises(PluginError, match=r"disabled .*tempdir \(planaria_fixture_good 1.0\)"):
        manager.resolve(PluginKind.HEALTH_CHECK, "temp_dir")

    monkeypatch.setenv("PLANARIA_DISABLE_PLUGINS", "planaria-fixture-good, host")
    manager = PluginManager.from_entry_points()
    assert manager.plugins["tempdir"].status is PluginStatus.BLOCKED
    assert manager.plugins["host"].status is PluginStatus.BLOCKED
    assert not {"host", "temp_dir"} & set(manager.records(PluginKind.HEALTH_CHECK))


def test_misspelled_hook_fails_that_plugin_with_a_suggestion(plugin_path):
    plugin_path("typo", "good")
    manager = PluginManager.from_entry_points()
    info = manager.plugins["typocheck"]
    assert info.status is PluginStatus.FAILED
    assert "planaria_helth_checks" in info.reason
    assert "did you mean 'planaria_health_checks'" in info.reason
    assert manager.plugins["tempdir"].status is PluginStatus.LOADED


def test_hook_returning_garbage_fails_that_plugin(plugin_path):
    plugin_path("badrecord")
    manager = PluginManager.from_entry_points()
    assert "host" in manager.records(PluginKind.HEALTH_CHECK)
    info = manager.plugins["badrecord"]
    assert info.status is PluginStatus.FAILED
    assert "must return HealthCheckRecord records, got dict" in info.reason


def test_duplicate_names_name_both_distributions(plugin_path):
    plugin_path("dup")
    manager = PluginManager.from_entry_points()
    with pytest.raises(DuplicatePluginError) as exc:
        manager.records(PluginKind.HEALTH_CHECK)
    message = str(exc.value)
    assert "'host'" in message
    assert "planaria 0" in message and "planaria_fixture_dup 1.0" in message
    # Disabling one of the two resolves the conflict.
    manager = PluginManager.from_entry_points(disable=["otherhost"])
    assert "host" in manager.records(PluginKind.HEALTH_CHECK)


def test_unknown_name_lists_installed_ones_and_the_package_to_install(plugin_path):
    manager = PluginManager.from_entry_points()
    with pytest.raises(PluginNotFoundError) as exc:
        manager.resolve(PluginKind.HEALTH_CHECK, "nosuch")
    assert "Choose one of: " in str(exc.value) and "host" in str(exc.value)
    with pytest.raises(PluginNotFoundError, match="pip install planaria-fsspec"):
        manager.resolve(PluginKind.CHECKPOINT_STORAGE, "fsspec")
    with pytest.raises(PluginNotFoundError) as exc:  # no such distribution: nothing to install
        manager.resolve(PluginKind.SCHEDULER, "nosuchcluster")
    said = str(exc.value)
    assert "pip install" not in said and "Choose one of: external, local" in said
    for name in ("slurm", "ray", "kubernetes"):  # this repository's schedulers
        with pytest.raises(PluginNotFoundError, match=f"pip install planaria-{name}"):
            manager.resolve(PluginKind.SCHEDULER, name)
    if "nvidia" not in {ep.name for ep in entry_points(group="planaria")}:
        with pytest.raises(PluginNotFoundError, match="pip install planaria-nvidia"):
            manager.resolve(PluginKind.HEALTH_CHECK, "NVIDIA")
    else:  # the core's test env installs this repository's plugins: blocked, it says so
        manager = PluginManager.from_entry_points(disable=["nvidia"])
        with pytest.raises(
            PluginLoadError, match=r"provided by planaria-nvidia .*, which is disab"
        ):
            manager.resolve(PluginKind.HEALTH_CHECK, "NVIDIA")


def test_job_event_observers_are_isolated_from_each_other(plugin_path):
    import planaria_fixture_good  # type: ignore[import-not-found]

    plugin_path("good")
    manager = PluginManager.from_entry_points()

    class Exploding:
        @planaria.hookimpl
        def planaria_job_event(self, event):
            raise RuntimeError("pager down")

    class NoArgs:
        calls = 0

        @planaria.hookimpl
        def planaria_job_event(self):
            NoArgs.calls += 1

    manager.register(Exploding(), "exploding")
    manager.register(NoArgs(), "noargs")
    before = len(planaria_fixture_good.EVENTS)
    replaced = NodeReplaced(host="h1", replacement="n2", replacement_host="h2")
    event = JobEvent.of(replaced, job="j", node="n1", message="xid 79")
    manager.emit(event)
    assert planaria_fixture_good.EVENTS[before:] == [event]
    assert NoArgs.calls == 1


def test_record_validation():
    class Check(HealthCheck[NoOptions]):
        def run(self):
            return []

    with pytest.raises(ValueError, match="must start with a letter"):
        HealthCheckRecord(name="9lives", factory=Check)
    with pytest.raises(ValueError, match="extra='forbid'"):
        from pydantic import BaseModel

        class Loose(BaseModel):
            x: int = 1

        HealthCheckRecord(name="loose", factory=Check, options=Loose)
    with pytest.raises(ValueError):
        HealthCheckRecord(name="wrongtype", factory=dict)
    record = HealthCheckRecord(name=" My-Check ", factory=Check, summary="two\n lines")
    assert (record.name, record.summary) == ("my_check", "two lines")
    with pytest.raises(ValueError):
        record.name = "other"  # type: ignore[misc]


def test_a_record_that_fails_validation_is_reported_on_one_line():
    from pydantic import BaseModel

    class Loose(BaseModel):
        x: int = 1

    class Check(HealthCheck[NoOptions]):
        def run(self):
            return []

    class Plugin:
        @planaria.hookimpl
        def planaria_health_checks(self):
            return [HealthCheckRecord(name="loose", factory=Check, options=Loose)]

    manager = PluginManager()
    manager.register(Plugin(), "loose", distribution="planaria-loose", version="2.0")
    assert manager.records(PluginKind.HEALTH_CHECK) == {}
    reason = manager.plugins["loose"].reason
    assert "\n" not in reason
    assert "planaria_health_checks() failed: HealthCheckRecord is invalid: options:" in reason
    assert "extra='forbid'" in reason
