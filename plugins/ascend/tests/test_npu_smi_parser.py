"""The npu-smi parsers on recorded output of real models, and on output they must refuse."""

from __future__ import annotations

import pytest
from conftest import NPU_SMI
from hypothesis import given
from hypothesis import strategies as st

from planaria_ascend.npu_smi import NpuSmiParseError, field_number, parse_fields, parse_info


def read(name: str) -> str:
    return (NPU_SMI / name).read_text()


def test_910b_eight_npus() -> None:
    info = parse_info(read("info_910b_healthy.txt"))
    assert info.version == "24.1.rc2"
    assert [(c.npu, c.chip) for c in info.chips] == [(i, 0) for i in range(8)]
    first = info.chips[0]
    assert (first.name, first.health, first.line) == ("910B3", "OK", 7)
    assert first.number("Temp(C)") == 36.0
    assert first.number("Power(W)") == 93.6
    assert first.usage("HBM-Usage(MB)") == (3379.0, 65536.0)
    assert first.usage("Memory-Usage(MB)") == (0.0, 0.0)
    assert first.fields["bus-id"] == "0000:C1:00.0"
    assert info.processes == []


def test_health_column() -> None:
    info = parse_info(read("info_910b_alarm.txt"))
    assert {c.npu: c.health for c in info.chips if c.health != "OK"} == {2: "Warning", 5: "Alarm"}


def test_process_table() -> None:
    (process,) = parse_info(read("info_910b_busy.txt")).processes
    assert (process.npu, process.chip, process.pid, process.name) == (5, 0, 2865645, "python3")
    assert process.memory_mb == 56131.0


def test_310p_columns_differ() -> None:
    info = parse_info(read("info_310p.txt"))
    assert info.version == "23.0.0"
    assert [(c.npu, c.chip, c.fields["device"]) for c in info.chips] == [(0, 0, "0"), (1, 0, "1")]
    assert info.chips[0].usage("Memory-Usage(MB)") == (1074.0, 21534.0)
    assert info.chips[0].usage("HBM-Usage(MB)") is None
    assert info.chips[1].number("Temp(C)") is None  # printed NA
    assert info.chips[1].number("Power(W)") is None


def test_a3_two_chips_per_npu() -> None:
    info = parse_info(read("info_a3_dual_chip.txt"))
    assert [(c.npu, c.chip, c.fields["phy-id"]) for c in info.chips] == [
        (0, 0, "0"),
        (0, 1, "1"),
        (1, 0, "2"),
        (1, 1, "3"),
    ]
    assert info.chips[1].number("Power(W)") is None  # "-" on the second chip


def test_text_around_the_tables_is_ignored() -> None:
    text = "Warning: the driver is older than the firmware\n\n" + read("info_910b_healthy.txt")
    text += "\nCANN:\npackage_name=Ascend-cann-toolkit\nversion=8.0.0\n"
    assert len(parse_info(text).chips) == 8


def test_a_row_that_does_not_fit_names_its_line() -> None:
    with pytest.raises(
        NpuSmiParseError, match=r"^line 20: expected 3 cells like the header, found 4"
    ):
        parse_info(read("info_broken_row.txt"))


def test_a_cell_with_too_many_values_names_its_line() -> None:
    text = read("info_910b_healthy.txt").replace("| 93.6        36 ", "| 93.6    36  36 ")
    with pytest.raises(NpuSmiParseError, match=r"^line 7: cell .* holds 4 value\(s\) but its"):
        parse_info(text)


def test_a_device_row_without_its_second_row() -> None:
    lines = read("info_910b_healthy.txt").splitlines()
    del lines[28]  # NPU 7's second row
    with pytest.raises(NpuSmiParseError, match=r"^line 28: the device row has no second row"):
        parse_info("\n".join(lines))


def test_a_non_numeric_npu_id() -> None:
    text = read("info_910b_healthy.txt").replace("| 3     910B3", "| x     910B3")
    with pytest.raises(NpuSmiParseError, match=r"^line 16: NPU id 'x' is not a number"):
        parse_info(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no device table .* the output is empty"),
        ("dcmi model initialized failed. ret is -8020\n", "it begins with 'dcmi model"),
        ("+----+\n| hello |\n+----+\n", "no device table"),
    ],
)
def test_output_without_a_device_table(text: str, message: str) -> None:
    with pytest.raises(NpuSmiParseError, match=message):
        parse_info(text)


@given(st.text(alphabet=st.sampled_from("|+-= \nNPUName0123OK/abc."), max_size=400))
def test_any_output_parses_or_fails_clearly(text: str) -> None:
    try:
        parse_info(text)
    except NpuSmiParseError as exc:
        assert str(exc)


def test_key_value_queries() -> None:
    health = parse_fields(read("health_alarm.txt"))
    assert health["Health Status"] == "Alarm"
    assert health["Error Code"] == "80CF8009"
    ecc = parse_fields(read("ecc_double_bit.txt"))
    assert field_number(ecc, "HBM Double Bit Error Count") == 3.0
    assert field_number(ecc, "HBM Single Bit Error Count") == 17.0
    assert field_number(parse_fields(read("ecc_na.txt")), "HBM Double Bit Error Count") is None
    assert field_number(parse_fields(read("temp.txt")), "NPU Temperature (C)") == 41.0


def test_key_value_garbage() -> None:
    with pytest.raises(NpuSmiParseError, match=r"no 'Key : value' line .* it begins with"):
        parse_fields("not a table at all\n")
