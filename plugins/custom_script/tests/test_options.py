from __future__ import annotations

import os
from pathlib import Path

import pytest
from custom_script_helpers import MakeScript
from pydantic import ValidationError

from planaria_custom_script import CustomScriptOptions


def _error_at(exc: pytest.ExceptionInfo[ValidationError], field: str) -> str:
    errors = exc.value.errors()
    assert [e["loc"] for e in errors] == [(field,)]
    return str(errors[0]["msg"])


def test_defaults(make_script: MakeScript) -> None:
    script = make_script("exit 0")
    opts = CustomScriptOptions(path=script)
    assert opts.path == script
    assert (opts.args, opts.timeout, opts.env, opts.kill_grace) == ([], 30.0, {}, 1.0)


def test_durations_and_relative_path(
    make_script: MakeScript, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_script("exit 0", name="rel.sh")
    monkeypatch.chdir(tmp_path)
    opts = CustomScriptOptions.model_validate(
        {"path": "rel.sh", "timeout": "5m", "kill_grace": "250ms", "args": ["-v"]}
    )
    assert opts.path == tmp_path / "rel.sh"
    assert opts.path.is_absolute()
    assert (opts.timeout, opts.kill_grace, opts.args) == (300.0, 0.25, ["-v"])


def test_missing_script_is_an_error_at_path(tmp_path: Path) -> None:
    with pytest.raises(ValidationError) as exc:
        CustomScriptOptions(path=tmp_path / "nope.sh")
    assert (
        _error_at(exc, "path")
        == f"Value error, custom script {tmp_path / 'nope.sh'} does not exist"
    )


def test_directory_is_an_error_at_path(tmp_path: Path) -> None:
    with pytest.raises(ValidationError) as exc:
        CustomScriptOptions(path=tmp_path)
    assert "is not a regular file" in _error_at(exc, "path")


def test_non_executable_script_is_an_error_at_path(tmp_path: Path) -> None:
    script = tmp_path / "plain.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    with pytest.raises(ValidationError) as exc:
        CustomScriptOptions(path=script)
    message = _error_at(exc, "path")
    assert f"custom script {script} is not executable" in message
    assert f"chmod +x {script}" in message


def test_unknown_key_is_rejected(make_script: MakeScript) -> None:
    with pytest.raises(ValidationError) as exc:
        CustomScriptOptions.model_validate({"path": str(make_script("exit 0")), "timeuot": "5s"})
    assert exc.value.errors()[0]["loc"] == ("timeuot",)
    assert exc.value.errors()[0]["type"] == "extra_forbidden"


@pytest.mark.parametrize("timeout", ["0s", "-1", "soon", "5 minutes"])
def test_bad_timeout_is_an_error_at_timeout(make_script: MakeScript, timeout: str) -> None:
    with pytest.raises(ValidationError) as exc:
        CustomScriptOptions.model_validate({"path": str(make_script("exit 0")), "timeout": timeout})
    assert "invalid duration" in _error_at(exc, "timeout")


@pytest.mark.parametrize("name", ["", "A=B", "NUL\0"])
def test_bad_env_name_is_rejected(make_script: MakeScript, name: str) -> None:
    with pytest.raises(ValidationError) as exc:
        CustomScriptOptions(path=make_script("exit 0"), env={name: "x"})
    assert "not valid" in _error_at(exc, "env")


def test_options_are_frozen(make_script: MakeScript) -> None:
    opts = CustomScriptOptions(path=make_script("exit 0"))
    with pytest.raises(ValidationError):
        opts.timeout = 1.0  # type: ignore[misc]
    assert os.fspath(opts.path).endswith("check.sh")
