"""The output protocol, line by line, without starting processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planaria.errors import HealthCheckError
from planaria.health.api import DeviceResult, Status
from planaria_custom_script.protocol import BadLine, parse_line, parse_stdout, verdict

SCRIPT = Path("/opt/site/check_chip.sh")


def test_full_line() -> None:
    line = (
        '{"device": "npu0", "status": "degraded", "detail": "hot", "metrics": {"t": 91, "u": 0.5}}'
    )
    assert parse_line(line) == DeviceResult(
        device="npu0", status=Status.DEGRADED, detail="hot", metrics={"t": 91.0, "u": 0.5}
    )


def test_minimal_line() -> None:
    assert parse_line('{"device": "gpu1", "status": "failed"}') == DeviceResult(
        device="gpu1", status=Status.FAILED
    )


def test_not_applicable_line() -> None:
    line = '{"device": "npu", "status": "not_applicable", "detail": "no npu-smi on this node"}'
    assert parse_line(line).status is Status.NOT_APPLICABLE


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("gpu0 ok", "not valid JSON"),
        ('{"device": "gpu0", "status": "ok"', "not valid JSON"),
        ('["gpu0", "ok"]', "expected a JSON object, got an array"),
        ('"ok"', "expected a JSON object, got a string"),
        ("42", "expected a JSON object, got a number"),
        ("null", "expected a JSON object, got null"),
        ('{"status": "ok"}', '"device" must be a non-empty string'),
        ('{"device": "", "status": "ok"}', '"device" must be a non-empty string'),
        ('{"device": 3, "status": "ok"}', '"device" must be a non-empty string'),
        (
            '{"device": "gpu0"}',
            "\"status\" must be one of 'ok', 'degraded', 'failed', 'not_applicable', got None",
        ),
        ('{"device": "gpu0", "status": "OK"}', "got 'OK'"),
        ('{"device": "gpu0", "status": "broken"}', "got 'broken'"),
        ('{"device": "gpu0", "status": "error"}', "got 'error'"),
        ('{"device": "gpu0", "status": "ok", "detail": 5}', '"detail" must be a string'),
        ('{"device": "gpu0", "status": "ok", "metrics": [1]}', '"metrics" must be an object'),
        (
            '{"device": "gpu0", "status": "ok", "metrics": {"a": "1"}}',
            "metric 'a' must be a number",
        ),
        (
            '{"device": "gpu0", "status": "ok", "metrics": {"a": true}}',
            "metric 'a' must be a number",
        ),
        ('{"device": "gpu0", "status": "ok", "metrics": {"a": NaN}}', "NaN is not a number"),
        ('{"device": "gpu0", "status": "ok", "metrics": {"a": 1e999}}', "metric 'a' is not finite"),
        ('{"device": "g", "status": "ok", "metrics": {"a": 1' + "0" * 400 + "}}", "too large"),
        ('{"device": "gpu0", "status": "ok", "temp": 3}', "unknown key(s) 'temp'"),
    ],
)
def test_bad_lines_say_what_is_wrong(line: str, reason: str) -> None:
    with pytest.raises(BadLine) as exc:
        parse_line(line)
    assert reason in str(exc.value)


def test_blank_lines_are_skipped_and_crlf_accepted() -> None:
    out = '\n  \n{"device": "a", "status": "ok"}\r\n\n{"device": "b", "status": "failed"}\n'
    assert [(r.device, r.status) for r in parse_stdout(SCRIPT, out)] == [
        ("a", Status.OK),
        ("b", Status.FAILED),
    ]


def test_line_separator_inside_a_json_string_is_not_a_line_break() -> None:
    out = json.dumps({"device": "a", "status": "ok", "detail": "x\u2028y"}, ensure_ascii=False)
    assert parse_stdout(SCRIPT, out)[0].detail == "x\u2028y"


def test_first_bad_line_is_quoted_with_its_number() -> None:
    out = '{"device": "a", "status": "ok"}\n\nprobing npu1...\n{"oops": 1}\nmore junk\n'
    with pytest.raises(HealthCheckError) as exc:
        parse_stdout(SCRIPT, out)
    message = str(exc.value)
    assert message.startswith(f"custom script {SCRIPT} broke the output protocol on stdout line 3")
    assert "not valid JSON" in message
    assert "'probing npu1...'" in message
    assert "(2 more bad lines after it)" in message
    assert "write diagnostics to stderr" in message


def test_long_bad_line_is_truncated() -> None:
    line = "x" * 5000
    with pytest.raises(HealthCheckError) as exc:
        parse_stdout(SCRIPT, line)
    assert "'" + "x" * 200 + "'... (5000 characters)" in str(exc.value)
    assert "x" * 201 not in str(exc.value)


def test_exit_0_without_lines_is_one_ok_result() -> None:
    assert verdict(SCRIPT, 0, "", "") == [
        DeviceResult(device="check_chip.sh", status=Status.OK, detail="exited 0")
    ]


def test_exit_0_keeps_a_failed_device() -> None:
    results = verdict(SCRIPT, 0, '{"device": "a", "status": "failed"}', "")
    assert results == [DeviceResult(device="a", status=Status.FAILED)]


def test_exit_1_without_failed_line_adds_a_failed_result_with_stderr() -> None:
    results = verdict(SCRIPT, 1, '{"device": "a", "status": "ok"}\n', "checking\nfan 3 stopped\n")
    assert results == [
        DeviceResult(device="a", status=Status.OK),
        DeviceResult(device="check_chip.sh", status=Status.FAILED, detail="fan 3 stopped"),
    ]
    assert verdict(SCRIPT, 1, "", "")[-1].detail == "exited with 1"


def test_exit_1_with_a_failed_line_adds_nothing() -> None:
    results = verdict(SCRIPT, 1, '{"device": "a", "status": "failed"}', "bad")
    assert results == [DeviceResult(device="a", status=Status.FAILED)]


def test_other_exit_codes_are_errors_quoting_stderr() -> None:
    stderr = "".join(f"line {i}\n" for i in range(10))
    with pytest.raises(HealthCheckError) as exc:
        verdict(SCRIPT, 3, '{"device": "a", "status": "ok"}', stderr)
    message = str(exc.value)
    assert f"custom script {SCRIPT} exited with code 3" in message
    assert "line 9" in message and "line 5" in message and "line 4" not in message


def test_signal_is_named() -> None:
    with pytest.raises(HealthCheckError, match=r"killed by signal 9 \(SIGKILL\); stderr was empty"):
        verdict(SCRIPT, -9, "", "")
