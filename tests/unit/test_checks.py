"""The host check and the runner's isolation of checks from each other."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from planaria.errors import HealthCheckError
from planaria.health.api import CheckContext, DeviceResult, HealthCheck, HealthCheckRecord, Status
from planaria.health.host import HostCheck, HostOptions, available_memory_bytes
from planaria.health.runner import ConfiguredCheck, run_checks
from planaria.plugin.records import NoOptions


def context(tmp_path: Path) -> CheckContext:
    return CheckContext(node="test-node", workdir=tmp_path)


def by_device(results: list[DeviceResult]) -> dict[str, DeviceResult]:
    return {r.device: r for r in results}


def test_host_check_passes_with_modest_thresholds(tmp_path):
    results = by_device(HostCheck(HostOptions(), context(tmp_path)).run())
    assert results[f"disk:{tmp_path}"].status is Status.OK
    assert results[f"disk:{tmp_path}"].metrics["free_bytes"] > 0
    assert results["shm"].status is Status.OK
    assert results["memory"].status is Status.OK
    assert results["memory"].metrics["available_bytes"] > 0


def test_host_check_fails_each_resource_on_its_own_threshold(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    options = HostOptions(
        min_free_disk=free * 1000,
        min_shm="1PiB",
        min_available_memory="1PiB",
        paths=[tmp_path / "not" / "yet" / "made"],
    )
    results = by_device(HostCheck(options, context(tmp_path)).run())
    assert results[f"disk:{tmp_path}"].status is Status.FAILED
    assert "minimum" in results[f"disk:{tmp_path}"].detail
    # A path the job has not created yet is measured on its nearest existing parent.
    assert results[f"disk:{tmp_path / 'not' / 'yet' / 'made'}"].status is Status.FAILED
    assert results["shm"].status is Status.FAILED
    assert results["memory"].status is Status.FAILED


def test_host_check_reports_a_missing_shm(tmp_path):
    results = by_device(
        HostCheck(HostOptions(shm_path=tmp_path / "no-shm"), context(tmp_path)).run()
    )
    assert results["shm"].status is Status.FAILED
    assert "does not exist" in results["shm"].detail


def test_available_memory_without_meminfo(tmp_path):
    assert available_memory_bytes(tmp_path / "nope") is None
    fake = tmp_path / "meminfo"
    fake.write_text("MemTotal: 100 kB\nMemAvailable:   2048 kB\n")
    assert available_memory_bytes(fake) == 2048 * 1024


class Behaviour:
    cancelled = threading.Event()


class Crashing(HealthCheck[NoOptions]):
    def run(self) -> list[DeviceResult]:
        return [DeviceResult(device="x", status=Status.OK)][5]


class Hanging(HealthCheck[NoOptions]):
    def __init__(self, options: NoOptions, ctx: CheckContext) -> None:
        super().__init__(options, ctx)
        self.stop = threading.Event()

    def run(self) -> list[DeviceResult]:
        self.stop.wait(30)
        return []

    def cancel(self) -> None:
        Behaviour.cancelled.set()
        self.stop.set()


class Undecided(HealthCheck[NoOptions]):
    def run(self) -> list[DeviceResult]:
        raise HealthCheckError("driver answered nonsense")


class Garbage(HealthCheck[NoOptions]):
    def run(self):  # type: ignore[no-untyped-def]
        return {"gpu0": "fine"}


class Empty(HealthCheck[NoOptions]):
    def run(self) -> list[DeviceResult]:
        return []


def configured(name: str, factory: type, timeout: float = 5.0) -> ConfiguredCheck:
    record = HealthCheckRecord(name=name, factory=factory)
    return ConfiguredCheck(name, record, NoOptions(), timeout)


def test_one_bad_check_never_hides_the_others(tmp_path):
    host = HealthCheckRecord(name="host", factory=HostCheck, options=HostOptions)
    checks = [
        configured("crashing", Crashing),
        configured("hanging", Hanging, timeout=0.5),
        ConfiguredCheck("host", host, HostOptions(), 10.0),
        configured("undecided", Undecided),
        configured("garbage", Garbage),
        configured("empty", Empty),
    ]
    seen = []
    started = time.monotonic()
    health = run_checks(checks, context(tmp_path), on_result=seen.append)
    elapsed = time.monotonic() - started
    results = {c.check: c for c in health.checks}
    assert [c.check for c in health.checks] == [c.name for c in checks]
    assert sorted(r.check for r in seen) == sorted(results)

    assert results["crashing"].status is Status.ERROR
    assert "IndexError" in results["crashing"].error
    assert "test_checks.py" in results["crashing"].error
    assert results["hanging"].status is Status.ERROR
    assert results["hanging"].error == "timed out after 0.5s"
    assert Behaviour.cancelled.wait(2)
    assert results["host"].status is Status.OK
    assert results["undecided"].error == "driver answered nonsense"
    assert "expected a list of DeviceResult" in results["garbage"].error
    assert results["empty"].status is Status.NOT_APPLICABLE

    assert not health.healthy
    assert health.status is Status.ERROR
    # Checks run concurrently: the hanging one costs its timeout, not more.
    assert elapsed < 5


def test_degraded_and_not_applicable_keep_a_node_healthy():
    assert Status.DEGRADED.healthy and Status.NOT_APPLICABLE.healthy
    assert not Status.FAILED.healthy and not Status.ERROR.healthy
    assert Status.worst([Status.OK, Status.DEGRADED, Status.NOT_APPLICABLE]) is Status.DEGRADED


class LateFinisher(HealthCheck[NoOptions]):
    """Overruns its timeout, then returns a healthy verdict that must not count."""

    def run(self) -> list[DeviceResult]:
        time.sleep(0.6)
        return [DeviceResult(device="x", status=Status.OK)]


class SlowToBuild(HealthCheck[NoOptions]):
    cancelled = threading.Event()

    def __init__(self, options: NoOptions, ctx: CheckContext) -> None:
        time.sleep(0.6)
        super().__init__(options, ctx)

    def run(self) -> list[DeviceResult]:
        raise AssertionError("run() must not start after the runner gave up")

    def cancel(self) -> None:
        SlowToBuild.cancelled.set()


def test_a_verdict_after_the_timeout_never_replaces_the_timeout(tmp_path):
    seen = []
    health = run_checks(
        [configured("late", LateFinisher, 0.2), configured("slow_build", SlowToBuild, 0.2)],
        context(tmp_path),
        on_result=seen.append,
    )
    time.sleep(0.8)  # let both threads finish after their timeouts
    assert [r.status for r in health.checks] == [Status.ERROR, Status.ERROR]
    assert [r.status for r in seen] == [Status.ERROR, Status.ERROR]
    # A check still being built when its time ran out is cancelled once it exists.
    assert SlowToBuild.cancelled.wait(2)


def test_a_metric_must_be_a_number_not_a_boolean_or_a_string():
    ok = DeviceResult(device="gpu0", status=Status.OK, metrics={"temp_c": 61, "util": 0.5})
    assert ok.metrics == {"temp_c": 61, "util": 0.5}
    for bad in (True, "61", None):
        with pytest.raises(ValidationError, match=r"metrics\.x"):
            DeviceResult(device="gpu0", status=Status.OK, metrics={"x": bad})


class ClaimsError(HealthCheck[NoOptions]):
    def run(self) -> list[DeviceResult]:
        return [DeviceResult(device="gpu0", status=Status.ERROR)]


def test_a_device_cannot_be_error_only_the_runner_gives_it(tmp_path):
    with pytest.raises(
        ValidationError, match=r"a device's status cannot be 'error'.*HealthCheckError"
    ):
        DeviceResult(device="gpu0", status=Status.ERROR)
    with pytest.raises(ValidationError, match="cannot be 'error'"):
        DeviceResult.model_validate({"device": "gpu0", "status": "error"})
    # A check that tries anyway gets the runner's own error, which quotes why.
    health = run_checks([configured("claims", ClaimsError)], context(tmp_path))
    (result,) = health.checks
    assert result.status is Status.ERROR and result.devices == []
    assert "ValidationError" in result.error and "cannot be 'error'" in result.error
