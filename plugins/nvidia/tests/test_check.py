"""The ``nvidia`` check's verdicts on recorded node states (a fake NVML, see fake_nvml.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest
from conftest import RunFake
from fake_nvml import FakeNvml, load_fixture

from planaria.errors import HealthCheckError
from planaria.health.api import CheckContext, Status
from planaria_nvidia import NvidiaCheck, NvidiaOptions
from planaria_nvidia.session import NvmlSession


def statuses(results: dict[str, object]) -> dict[str, Status]:
    return {name: r.status for name, r in results.items()}  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("fixture", "name", "total"),
    [
        ("healthy_h100.json", "NVIDIA H100 80GB HBM3", 85520809984),
        ("healthy_h200.json", "NVIDIA H200", 150754820096),
    ],
)
def test_healthy_node(run_fake: RunFake, fixture: str, name: str, total: int) -> None:
    results, fake = run_fake(fixture, expected_devices=8)
    assert statuses(results) == {"nvidia": Status.OK, **{f"gpu{i}": Status.OK for i in range(8)}}
    assert results["nvidia"].metrics == {"devices": 8.0}
    assert "8 GPU(s), driver " in results["nvidia"].detail
    gpu1 = results["gpu1"]
    assert gpu1.detail == f"{name}, 35 C, PCIe gen 5 x16"
    assert gpu1.metrics["pcie_width"] == gpu1.metrics["pcie_max_width"] == 16.0
    assert gpu1.metrics["temperature_c"] == 35.0
    assert gpu1.metrics["ecc_uncorrectable_volatile"] == 0.0
    assert gpu1.metrics["remapped_rows_pending"] == 0.0
    assert gpu1.metrics["nvlink_active_links"] == 18.0
    assert gpu1.metrics["nvlink_crc_errors"] == 0.0
    assert gpu1.metrics["memory_total_bytes"] == float(total)
    assert gpu1.metrics["clocks_event_reasons"] == 1.0  # GPU idle: not a fault
    # Row remapping answered, so retired pages were never asked for.
    assert not [c for c in fake.calls if c[0].startswith("device_get_retired_pages")]


def test_xid_polling_never_blocks(run_fake: RunFake) -> None:
    _, fake = run_fake("healthy_h100.json")
    waits = [args for name, args in fake.calls if name == "event_set_wait"]
    assert waits and all(timeout == 0 for _, timeout in waits)
    registered = [args for name, args in fake.calls if name == "device_register_events"]
    assert len(registered) == 8
    assert all(types == pynvml.nvmlEventTypeXidCriticalError for _, types, _ in registered)


def test_expected_device_count(run_fake: RunFake) -> None:
    results, _ = run_fake("missing_gpu.json", expected_devices=8)
    assert results["nvidia"].status is Status.FAILED
    assert results["nvidia"].detail.startswith("found 7 GPU(s), expected 8")
    assert list(results) == ["nvidia", *[f"gpu{i}" for i in range(7)]]
    # Unset, any number of GPUs above zero is fine.
    results, _ = run_fake("missing_gpu.json")
    assert results["nvidia"].status is Status.OK


def test_no_gpu_with_a_driver_fails(run_fake: RunFake) -> None:
    fake = FakeNvml("healthy_h100.json")
    fake.devices = []
    fake.fixture["count"] = 0
    check = NvidiaCheck(NvidiaOptions(), CheckContext(node="n", workdir="."), NvmlSession(fake))
    (inventory,) = check.run()
    assert inventory.status is Status.FAILED
    assert "reports no GPU" in inventory.detail


def test_uncorrectable_ecc_fails(run_fake: RunFake) -> None:
    results, _ = run_fake("ecc_uncorrectable.json")
    assert results["gpu2"].status is Status.FAILED
    assert "2 uncorrectable ECC error(s) since the driver loaded (max 0)" in results["gpu2"].detail
    assert results["gpu2"].metrics["ecc_uncorrectable_volatile"] == 2.0
    assert all(results[f"gpu{i}"].status is Status.OK for i in (0, 1, 3, 4, 5, 6, 7))
    # A threshold that tolerates them.
    results, _ = run_fake("ecc_uncorrectable.json", max_uncorrectable_ecc=2)
    assert results["gpu2"].status is Status.OK


def test_remapped_rows_pending_fails(run_fake: RunFake) -> None:
    results, _ = run_fake("remap_pending.json")
    assert results["gpu4"].status is Status.FAILED
    assert "row remapping pending: reset the GPU" in results["gpu4"].detail
    assert results["gpu4"].metrics["remapped_rows_pending"] == 1.0


def test_remapped_rows_failure_fails(run_fake: RunFake) -> None:
    results, _ = run_fake("remap_failed.json")
    assert results["gpu6"].status is Status.FAILED
    assert "row remapping failed" in results["gpu6"].detail
    assert results["gpu6"].metrics["remapped_rows_uncorrectable"] == 8.0


def test_older_gpus_use_retired_pages(run_fake: RunFake) -> None:
    results, fake = run_fake("v100_retired_pages.json")
    assert statuses(results) == {
        "nvidia": Status.OK,
        "gpu0": Status.OK,
        "gpu1": Status.FAILED,
        "gpu2": Status.OK,
        "gpu3": Status.FAILED,
    }
    assert "retired pages pending: reset the GPU" in results["gpu1"].detail
    assert results["gpu1"].metrics["retired_pages_double_bit"] == 1.0
    assert "61 retired pages (limit 60)" in results["gpu3"].detail
    assert results["gpu3"].metrics["retired_pages_single_bit"] == 50.0
    # NOT_SUPPORTED on row remapping (pre-Ampere) is no fault, only a note.
    assert "not supported here: remapped rows" in results["gpu0"].detail
    # This container refuses XID event registration: said, not failed.
    assert "XID events cannot be watched here (Not Supported)" in results["gpu0"].detail
    assert results["gpu0"].metrics["nvlink_active_links"] == 6.0
    # Six links: the seventh state query answers INVALID_ARGUMENT and ends the list.
    states = [a[1] for n, a in fake.calls if n == "device_get_nvlink_state" and a[0] is not None]
    assert max(states) == 6


def test_fatal_xid_since_last_check(run_fake: RunFake, context: CheckContext) -> None:
    fake = FakeNvml("xid_fatal.json")
    session = NvmlSession(fake)
    results = {r.device: r for r in NvidiaCheck(NvidiaOptions(), context, session).run()}
    assert results["gpu3"].status is Status.FAILED
    assert "XID 79 (GPU has fallen off the bus) since the last check" in results["gpu3"].detail
    # An application's own fault is reported, not held against the GPU.
    assert results["gpu0"].status is Status.OK
    assert "XID 13 (graphics engine exception) x2 since the last check" in results["gpu0"].detail
    assert results["gpu0"].metrics["xid_events"] == 2.0
    assert results["gpu5"].status is Status.DEGRADED
    assert "XID 92 (high single-bit ECC error rate)" in results["gpu5"].detail
    assert results["gpu?"].status is Status.FAILED
    assert "XID 119 (GSP RPC timeout)" in results["gpu?"].detail

    # The event set lives in the session: the next check sees only newer XIDs.
    again = {r.device: r for r in NvidiaCheck(NvidiaOptions(), context, session).run()}
    assert all(r.status is Status.OK for r in again.values()), again
    assert "gpu?" not in again
    fake.raise_xid(1, 48)
    third = {r.device: r for r in NvidiaCheck(NvidiaOptions(), context, session).run()}
    assert third["gpu1"].status is Status.FAILED
    assert "XID 48 (double-bit (uncorrectable) ECC error)" in third["gpu1"].detail
    assert [n for n, _ in fake.calls].count("event_set_create") == 1
    assert [n for n, _ in fake.calls].count("init") == 1


def test_fatal_xids_are_options(run_fake: RunFake) -> None:
    results, _ = run_fake("xid_fatal.json", fatal_xids=[13], degraded_xids=[])
    assert results["gpu0"].status is Status.FAILED
    assert results["gpu3"].status is Status.OK
    assert "XID 79 (GPU has fallen off the bus) since the last check (not a hardware fault)" in (
        results["gpu3"].detail
    )
    assert results["gpu5"].status is Status.OK


def test_thermal_throttling_and_heat_degrade(run_fake: RunFake) -> None:
    results, _ = run_fake("throttled_hot.json")
    gpu7 = results["gpu7"]
    assert gpu7.status is Status.DEGRADED
    assert "clocks throttled: HW thermal slowdown, SW thermal slowdown" in gpu7.detail
    assert "temperature 91 C (max 85 C)" in gpu7.detail
    assert gpu7.metrics["clocks_event_reasons"] == 96.0
    # The power cap alone is the workload at work, not a fault, unless asked for.
    assert results["gpu2"].status is Status.OK
    results, _ = run_fake("throttled_hot.json", throttle_reasons=["sw_power_cap"])
    assert results["gpu2"].status is Status.DEGRADED
    assert "SW power cap" in results["gpu2"].detail


def test_hw_slowdown_degrades(run_fake: RunFake) -> None:
    results, _ = run_fake("hw_slowdown.json")
    assert results["gpu1"].status is Status.DEGRADED
    assert "clocks throttled: HW slowdown, HW power brake" in results["gpu1"].detail


def test_temperature_threshold_is_an_option(run_fake: RunFake) -> None:
    results, _ = run_fake("healthy_h100.json", max_temperature=34)
    assert {d for d, r in results.items() if r.status is Status.DEGRADED} == {"gpu1", "gpu7"}
    assert "temperature 36 C (max 34 C)" in results["gpu7"].detail


def test_nvlink_errors_fail(run_fake: RunFake) -> None:
    results, _ = run_fake("nvlink_errors.json")
    gpu5 = results["gpu5"]
    assert gpu5.status is Status.FAILED
    assert "NVLink 11: 1462 crc errors (max 100)" in gpu5.detail
    assert "NVLink 11: 310 replay errors (max 100)" in gpu5.detail
    assert "recovery" not in gpu5.detail  # 2 <= 10
    assert "NVLink 3" not in gpu5.detail
    assert gpu5.metrics["nvlink_active_links"] == 17.0
    assert gpu5.metrics["nvlink_crc_errors"] == 1466.0
    assert gpu5.metrics["nvlink_replay_errors"] == 311.0
    results, _ = run_fake("nvlink_errors.json", max_nvlink_recovery_errors=1)
    assert "NVLink 11: 2 recovery errors (max 1)" in results["gpu5"].detail


def test_foreign_memory_degrades_and_fails_above_its_limit(run_fake: RunFake) -> None:
    results, _ = run_fake("foreign_memory.json")
    gpu0 = results["gpu0"]
    assert gpu0.status is Status.DEGRADED
    assert "71680 MiB held by processes not of this job: pid 48213 (71680 MiB" in gpu0.detail
    results, fake = run_fake("foreign_memory.json", flag_foreign_processes=False)
    assert results["gpu0"].status is Status.OK
    assert not [c for c in fake.calls if c[0] == "device_get_compute_running_processes"]
    results, _ = run_fake("foreign_memory.json", max_foreign_memory="1GiB")
    gpu0 = results["gpu0"]
    assert gpu0.status is Status.FAILED
    assert "71680 MiB already held by other processes (max 1024 MiB): pid 48213" in gpu0.detail
    assert gpu0.metrics["foreign_memory_bytes"] == 75161927680.0
    assert results["gpu1"].status is Status.OK
    assert results["gpu1"].metrics["foreign_processes"] == 0.0


def test_a_killed_workers_context_is_flagged_and_the_jobs_own_are_not(
    run_fake: RunFake, tmp_path: Path
) -> None:
    """pid 4194000 no longer exists (the killed worker); pid 1 is alive and not ours; this
    process and its child are the job's own and are never flagged."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        fixture = load_fixture("leftover_context.json")
        fixture["devices"]["2"] = {
            "processes": [
                {"pid": os.getpid(), "used_gpu_memory": 1 << 30},
                {"pid": child.pid, "used_gpu_memory": 1 << 30},
            ]
        }
        path = tmp_path / "fixture.json"
        path.write_text(json.dumps(fixture))
        results, _ = run_fake(str(path))
    finally:
        child.kill()
        child.wait()
    gpu1 = results["gpu1"]
    assert gpu1.status is Status.DEGRADED
    assert (
        "31744 MiB held by processes not of this job: "
        "pid 4194000 (21504 MiB, exited: a leftover context), pid 1 (10240 MiB)"
    ) in gpu1.detail
    assert gpu1.metrics["foreign_processes"] == 2.0
    assert results["gpu2"].status is Status.OK
    assert results["gpu2"].metrics["foreign_processes"] == 0.0


def test_pcie_link_width_and_generation(run_fake: RunFake) -> None:
    results, fake = run_fake("pcie_link.json")
    # At idle a lower generation is power saving: noted, not degraded.
    gpu2 = results["gpu2"]
    assert gpu2.status is Status.OK
    assert gpu2.detail == (
        "NVIDIA H100 80GB HBM3, 33 C, PCIe gen 1 x16; PCIe link at gen 1 of 5 while idle "
        "(links train down at idle; judged only under load)"
    )
    # A narrower link is never idle power saving.
    gpu3 = results["gpu3"]
    assert gpu3.status is Status.DEGRADED
    assert gpu3.detail.startswith("PCIe link x8 of x16 (gen 5 of 5)")
    assert gpu3.metrics["pcie_width"] == 8.0
    # Busy and below its generation: degraded.
    gpu4 = results["gpu4"]
    assert gpu4.status is Status.DEGRADED
    assert gpu4.detail == "PCIe link gen 3 of 5 while the GPU is busy (97%)"
    assert gpu4.metrics["utilization_gpu"] == 97.0
    assert results["gpu0"].status is Status.OK
    # Utilization is read only where the generation is below its maximum.
    asked = [a[0] for n, a in fake.calls if n == "device_get_utilization_rates"]
    assert len(asked) == 2


def test_pcie_not_supported_is_noted(run_fake: RunFake, tmp_path: Path) -> None:
    fixture = load_fixture("healthy_h100.json")
    fixture["device"]["pcie"] = {"nvml_error": "NVML_ERROR_NOT_SUPPORTED"}
    path = tmp_path / "fixture.json"
    path.write_text(json.dumps(fixture))
    results, _ = run_fake(str(path))
    assert results["gpu0"].status is Status.OK
    assert results["gpu0"].detail == ("NVIDIA H100 80GB HBM3, 33 C; not supported here: PCIe link")


def test_a_lost_gpu_fails_alone(run_fake: RunFake) -> None:
    results, _ = run_fake("gpu_lost.json")
    assert results["gpu6"].status is Status.FAILED
    assert "device handle: GPU is lost (NVML error 15)" in results["gpu6"].detail
    assert all(results[f"gpu{i}"].status is Status.OK for i in (0, 1, 2, 3, 4, 5, 7))


def test_not_supported_everywhere_is_ok_and_said(run_fake: RunFake) -> None:
    results, _ = run_fake("not_supported.json")
    assert statuses(results) == {"nvidia": Status.OK, "gpu0": Status.OK, "gpu1": Status.OK}
    detail = results["gpu0"].detail
    assert detail.startswith("NVIDIA H100 PCIe, 33 C")
    assert (
        "not supported here: ECC counters, remapped rows, retired pages, clock event reasons, "
        "NVLink" in detail
    )
    assert "XID events cannot be watched here (Not Supported)" in detail
    assert "nvlink_active_links" not in results["gpu0"].metrics
    assert results["gpu0"].metrics["temperature_c"] == 33.0


def test_an_unexpected_nvml_error_fails_that_gpu_alone(run_fake: RunFake) -> None:
    results, _ = run_fake("no_permission.json")
    assert results["gpu0"].status is Status.FAILED  # it cannot be verified
    assert "reading ECC counters failed: Insufficient Permissions (NVML error 4)" in (
        results["gpu0"].detail
    )
    assert results["gpu1"].status is Status.OK


def test_driver_not_loaded_is_not_applicable(run_fake: RunFake) -> None:
    results, fake = run_fake("driver_not_loaded.json")
    assert list(results) == ["nvidia"]
    assert results["nvidia"].status is Status.NOT_APPLICABLE
    assert results["nvidia"].detail == (
        "no NVIDIA driver on this node: NVML cannot start (Driver Not Loaded)"
    )
    assert [n for n, _ in fake.calls] == ["init"]


def test_a_broken_driver_is_a_check_error(context: CheckContext) -> None:
    check = NvidiaCheck(NvidiaOptions(), context, NvmlSession(FakeNvml("version_mismatch.json")))
    with pytest.raises(HealthCheckError, match="NVML cannot start: RM has detected an NVML/RM"):
        check.run()


def test_a_failed_start_is_tried_again(context: CheckContext) -> None:
    fake = FakeNvml("driver_not_loaded.json")
    session = NvmlSession(fake)
    (result,) = NvidiaCheck(NvidiaOptions(), context, session).run()
    assert result.status is Status.NOT_APPLICABLE
    fake.fixture["init_error"] = None  # the driver got loaded
    results = NvidiaCheck(NvidiaOptions(), context, session).run()
    assert [r.status for r in results] == [Status.OK] * 9
