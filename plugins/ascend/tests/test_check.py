"""The ``ascend`` check against fake npu-smi executables printing recorded output."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import FakeNpuSmi, calls

from planaria.errors import HealthCheckError
from planaria.health.api import CheckContext, DeviceResult, Status
from planaria.process import running
from planaria_ascend import AscendCheck, AscendOptions


def run(context: CheckContext, **options: object) -> dict[str, DeviceResult]:
    results = AscendCheck(AscendOptions.model_validate(options), context).run()
    by_device = {r.device: r for r in results}
    assert len(by_device) == len(results)
    return by_device


def test_healthy_910b(fake_npu_smi: FakeNpuSmi, context: CheckContext, tmp_path: Path) -> None:
    fake_npu_smi()
    results = run(context, expected_devices=8)
    assert {d: r.status for d, r in results.items()} == {
        "ascend": Status.OK,
        **{f"npu{i}": Status.OK for i in range(8)},
    }
    assert results["ascend"].detail == "8 NPU chip(s) in npu-smi"
    npu0 = results["npu0"]
    assert npu0.detail == "910B3, 36 C"
    assert npu0.metrics == {
        "ecc_double_bit_errors": 0.0,
        "ecc_single_bit_errors": 0.0,
        "ecc_isolated_pages": 0.0,
        "temperature_c": 36.0,
        "memory_used_mb": 3379.0,
        "memory_total_mb": 65536.0,
        "power_w": 93.6,
    }
    # argv as npu-smi expects it; health details are only asked for when not OK.
    log = calls(tmp_path)
    assert log[0] == "info"
    assert "info -t ecc -i 3 -c 0" in log
    assert not [c for c in log if "-t health" in c or "-t temp" in c]


def test_warning_and_alarm_health(
    fake_npu_smi: FakeNpuSmi, context: CheckContext, tmp_path: Path
) -> None:
    fake_npu_smi(
        info="info_910b_alarm.txt", health={2: "health_warning.txt", 5: "health_alarm.txt"}
    )
    results = run(context)
    assert results["npu2"].status is Status.DEGRADED
    assert results["npu2"].detail == (
        "health Warning: 80E01801 node type=SOC, sensor type=Temperature"
    )
    assert results["npu5"].status is Status.FAILED
    assert results["npu5"].detail.startswith("health Alarm: 80CF8009 node type=HBMC")
    assert all(results[f"npu{i}"].status is Status.OK for i in (0, 1, 3, 4, 6, 7))
    assert "info -t health -i 5 -c 0" in calls(tmp_path)


def test_double_bit_ecc_errors_fail(fake_npu_smi: FakeNpuSmi, context: CheckContext) -> None:
    fake_npu_smi(ecc={3: "ecc_double_bit.txt"})
    results = run(context)
    assert results["npu3"].status is Status.FAILED
    assert "3 uncorrectable (double-bit) ECC error(s) (max 0)" in results["npu3"].detail
    assert results["npu3"].metrics["ecc_single_bit_errors"] == 17.0
    assert results["npu3"].metrics["ecc_isolated_pages"] == 2.0
    assert run(context, max_hbm_double_bit_errors=3)["npu3"].status is Status.OK


def test_ecc_not_reported_is_noted(fake_npu_smi: FakeNpuSmi, context: CheckContext) -> None:
    fake_npu_smi(default_ecc="ecc_na.txt")
    results = run(context)
    assert results["npu0"].status is Status.OK
    assert results["npu0"].detail == "910B3, 36 C; ECC counts not reported"


def test_hot_npu_degraded(fake_npu_smi: FakeNpuSmi, context: CheckContext) -> None:
    fake_npu_smi(info="info_910b_hot.txt")
    results = run(context)
    assert results["npu6"].status is Status.DEGRADED
    assert results["npu6"].detail == "temperature 97 C (max 85 C)"
    assert run(context, max_temperature=100)["npu6"].status is Status.OK


def test_temperature_missing_from_the_table_is_queried(
    fake_npu_smi: FakeNpuSmi, context: CheckContext, tmp_path: Path
) -> None:
    fake_npu_smi(info="info_310p.txt")
    results = run(context)
    assert results["npu0"].detail == "310P3, 42 C"
    assert results["npu1"].detail == "310P3, 41 C"  # NA in the table: from -t temp
    assert results["npu1"].metrics["memory_total_mb"] == 21534.0
    assert "info -t temp -i 1 -c 0" in calls(tmp_path)


def test_two_chips_per_npu(fake_npu_smi: FakeNpuSmi, context: CheckContext) -> None:
    fake_npu_smi(info="info_a3_dual_chip.txt")
    results = run(context, expected_devices=4)
    assert sorted(results) == ["ascend", "npu0", "npu0.1", "npu1", "npu1.1"]
    assert all(r.status is Status.OK for r in results.values())


def test_missing_npu(fake_npu_smi: FakeNpuSmi, context: CheckContext) -> None:
    fake_npu_smi(info="info_910b_seven.txt")
    results = run(context, expected_devices=8)
    assert results["ascend"].status is Status.FAILED
    assert results["ascend"].detail == "found 7 NPU chip(s), expected 8"


def test_npu_smi_failing(fake_npu_smi: FakeNpuSmi, context: CheckContext) -> None:
    fake_npu_smi(info="dcmi_error.txt", info_exit=255)
    with pytest.raises(HealthCheckError) as caught:
        run(context)
    assert str(caught.value) == (
        "npu-smi info exited with code 255: "
        "dcmi model initialized failed, because the device is used. ret is -8020"
    )


def test_npu_smi_garbage(fake_npu_smi: FakeNpuSmi, context: CheckContext) -> None:
    fake_npu_smi(info="garbage.txt")
    with pytest.raises(HealthCheckError, match="cannot understand the output of npu-smi info: no"):
        run(context)


def test_npu_smi_broken_row(fake_npu_smi: FakeNpuSmi, context: CheckContext) -> None:
    fake_npu_smi(info="info_broken_row.txt")
    with pytest.raises(HealthCheckError, match="npu-smi info: line 20: expected 3 cells"):
        run(context)


def test_one_chip_query_failing_fails_that_chip_alone(
    fake_npu_smi: FakeNpuSmi, context: CheckContext
) -> None:
    fake_npu_smi(ecc={4: "garbage.txt"})
    results = run(context)
    assert results["npu4"].status is Status.FAILED  # it cannot be verified
    assert results["npu4"].detail.startswith(
        "cannot understand the output of npu-smi info -t ecc -i 4 -c 0: no 'Key : value' line"
    )
    assert results["npu3"].status is Status.OK


def _wait_dead(pids: list[int], timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if running(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if running(p)]


def test_npu_smi_hanging_is_killed_with_its_children(
    fake_npu_smi: FakeNpuSmi, context: CheckContext, tmp_path: Path
) -> None:
    fake_npu_smi(hang=True)
    with pytest.raises(
        HealthCheckError, match=r"/bin/npu-smi info did not finish within 0.5s; it was killed$"
    ):
        run(context, command_timeout="500ms")
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2
    assert _wait_dead(pids) == []


def test_cancel_kills_a_running_query(
    fake_npu_smi: FakeNpuSmi, context: CheckContext, tmp_path: Path
) -> None:
    import threading

    fake_npu_smi(hang=True)
    check = AscendCheck(AscendOptions(command_timeout=60), context)
    errors: list[BaseException] = []

    def target() -> None:
        try:
            check.run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    pids_file = tmp_path / "pids"
    deadline = time.monotonic() + 10
    while (
        time.monotonic() < deadline
        and len(pids_file.read_text().split() if pids_file.exists() else []) < 2
    ):
        time.sleep(0.05)
    check.cancel()
    thread.join(10)
    assert not thread.is_alive()
    assert errors and "cancelled" in str(errors[0])
    assert _wait_dead([int(p) for p in pids_file.read_text().split()]) == []


def test_neither_tool_is_not_applicable(context: CheckContext) -> None:
    (result,) = AscendCheck(AscendOptions(), context).run()
    assert result.device == "ascend"
    assert result.status is Status.NOT_APPLICABLE
    assert result.detail.startswith(
        "no Ascend NPU software on this node: npu-smi is not found (PATH="
    )
    assert result.detail.endswith(", and torch_npu is not installed")


def test_npu_smi_by_path(fake_npu_smi: FakeNpuSmi, context: CheckContext, tmp_path: Path) -> None:
    script = fake_npu_smi()
    moved = tmp_path / "opt" / "npu-smi"
    moved.parent.mkdir()
    script.rename(moved)
    assert run(context)["ascend"].status is Status.NOT_APPLICABLE
    assert run(context, npu_smi=str(moved))["ascend"].status is Status.OK
