"""The check against real scripts: exit codes, output, environment, working directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from custom_script_helpers import MakeScript, run_script

from planaria.errors import HealthCheckError
from planaria.health.api import CheckContext, DeviceResult, Status

EXAMPLE = Path(__file__).parents[1] / "examples" / "check_example.py"


def test_healthy_script_reports_each_line(make_script: MakeScript, context: CheckContext) -> None:
    script = make_script(
        """
echo '{"device": "gpu0", "status": "ok", "detail": "fine", "metrics": {"temp_c": 41}}'
echo 'diagnostics go to stderr' >&2
echo '{"device": "gpu1", "status": "degraded", "detail": "warm"}'
exit 0
"""
    )
    assert run_script(context, script) == [
        DeviceResult(device="gpu0", status=Status.OK, detail="fine", metrics={"temp_c": 41.0}),
        DeviceResult(device="gpu1", status=Status.DEGRADED, detail="warm"),
    ]


def test_silent_success_is_one_ok_result(make_script: MakeScript, context: CheckContext) -> None:
    script = make_script("exit 0", name="quiet.sh")
    assert run_script(context, script) == [
        DeviceResult(device="quiet.sh", status=Status.OK, detail="exited 0")
    ]


def test_unhealthy_script(make_script: MakeScript, context: CheckContext) -> None:
    script = make_script(
        """
echo '{"device": "npu0", "status": "ok"}'
echo 'HBM ECC count above limit' >&2
exit 1
""",
        name="npu.sh",
    )
    assert run_script(context, script) == [
        DeviceResult(device="npu0", status=Status.OK),
        DeviceResult(device="npu.sh", status=Status.FAILED, detail="HBM ECC count above limit"),
    ]


def test_garbage_output_names_script_and_first_bad_line(
    make_script: MakeScript, context: CheckContext
) -> None:
    script = make_script(
        """
echo '{"device": "gpu0", "status": "ok"}'
echo 'GPU 0: Tesla V100 (UUID: GPU-1234)'
echo 'more noise'
"""
    )
    with pytest.raises(HealthCheckError) as exc:
        run_script(context, script)
    message = str(exc.value)
    assert f"custom script {script} broke the output protocol on stdout line 2" in message
    assert "'GPU 0: Tesla V100 (UUID: GPU-1234)'" in message
    assert "not valid JSON" in message


def test_bad_fields_are_an_error(make_script: MakeScript, context: CheckContext) -> None:
    script = make_script("""echo '{"device": "gpu0", "status": "sick", "temp": 80}'""")
    with pytest.raises(HealthCheckError, match="stdout line 1: unknown key\\(s\\) 'temp'"):
        run_script(context, script)
    script = make_script("""echo '{"device": "gpu0", "status": "sick"}'""")
    with pytest.raises(HealthCheckError, match=r"\"status\" must be one of .* got 'sick'"):
        run_script(context, script)


def test_exit_code_3_is_an_error_with_stderr(
    make_script: MakeScript, context: CheckContext
) -> None:
    script = make_script(
        """
echo '{"device": "gpu0", "status": "ok"}'
echo 'nvidia-smi: command not found' >&2
exit 3
"""
    )
    with pytest.raises(HealthCheckError) as exc:
        run_script(context, script)
    message = str(exc.value)
    assert f"custom script {script} exited with code 3" in message
    assert "| nvidia-smi: command not found" in message


def test_death_by_signal_is_an_error(make_script: MakeScript, context: CheckContext) -> None:
    script = make_script("echo 'about to crash' >&2\nkill -SEGV $$\nsleep 5")
    with pytest.raises(HealthCheckError) as exc:
        run_script(context, script)
    message = str(exc.value)
    assert f"custom script {script} was killed by signal 11 (SIGSEGV)" in message
    assert "about to crash" in message


def test_args_env_node_and_workdir_reach_the_script(
    make_script: MakeScript, context: CheckContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INHERITED", "from-parent")
    script = make_script(
        """
read -r line || line="<eof>"   # stdin is /dev/null
for value in "$1" "$2" "$PWD" "$PLANARIA_NODE" "$INHERITED" "$EXTRA" "$line"; do
    printf '{"device": "%s", "status": "ok"}\\n' "$value"
done
"""
    )
    results = run_script(context, script, args=["a b", "$HOME;rm -rf /"], env={"EXTRA": "x"})
    assert [r.device for r in results] == [
        "a b",
        "$HOME;rm -rf /",
        str(context.workdir),
        "node-7",
        "from-parent",
        "x",
        "<eof>",
    ]


def test_huge_stdout_is_an_error(make_script: MakeScript, context: CheckContext) -> None:
    script = make_script("head -c 3000000 /dev/zero | tr '\\0' 'x'")
    with pytest.raises(HealthCheckError, match="wrote more than 1 MiB on stdout"):
        run_script(context, script)


def test_script_that_cannot_start(make_script: MakeScript, context: CheckContext) -> None:
    script = make_script("exit 0", shebang="#!/nonexistent/interpreter")
    with pytest.raises(HealthCheckError, match=f"custom script {script} could not be started"):
        run_script(context, script)


def test_missing_workdir(make_script: MakeScript, tmp_path: Path) -> None:
    context = CheckContext(node="n", workdir=tmp_path / "gone")
    with pytest.raises(HealthCheckError, match=r"work dir .*gone is missing"):
        run_script(context, make_script("exit 0"))


def test_python_script_with_unicode(make_script: MakeScript, context: CheckContext) -> None:
    line = json.dumps({"device": "npu0", "status": "ok", "detail": "température 41 °C"})
    script = make_script(f"print({line!r})", name="check.py", shebang="#!/usr/bin/env python3")
    assert run_script(context, script)[0].detail == "température 41 °C"


def test_shipped_example_follows_the_protocol(context: CheckContext, tmp_path: Path) -> None:
    zones = tmp_path / "thermal"
    for index, millidegrees in enumerate(["41000", "90000", "99500", "n/a"]):
        (zones / f"thermal_zone{index}").mkdir(parents=True)
        (zones / f"thermal_zone{index}" / "temp").write_text(millidegrees + "\n")
    results = run_script(context, EXAMPLE, args=["--zones", str(zones)])
    assert [(r.device, r.status) for r in results] == [
        ("thermal_zone0", Status.OK),
        ("thermal_zone1", Status.DEGRADED),
        ("thermal_zone2", Status.FAILED),
        ("thermal_zone3", Status.DEGRADED),
    ]
    assert results[2].metrics == {"temp_c": 99.5}
    assert results[2].detail == "99.5 C (warn at 85, fail at 95)"
    assert run_script(context, EXAMPLE, args=["--zones", str(tmp_path / "none")]) == [
        DeviceResult(device="check_example.py", status=Status.OK, detail="exited 0")
    ]
    with pytest.raises(HealthCheckError, match="exited with code 2"):
        run_script(context, EXAMPLE, args=["--max-temp", "hot"])
