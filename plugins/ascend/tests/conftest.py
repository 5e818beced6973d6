"""Fixtures: fake ``npu-smi`` executables on PATH and fake ``torch_npu`` packages on the path."""

from __future__ import annotations

import os
import shlex
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from planaria.health.api import CheckContext

FIXTURES = Path(__file__).parent / "fixtures"
NPU_SMI = FIXTURES / "npu-smi"

FakeNpuSmi = Callable[..., Path]


@pytest.fixture
def context(tmp_path: Path) -> CheckContext:
    return CheckContext(node="npu-node-1", workdir=tmp_path)


@pytest.fixture(autouse=True)
def no_tools(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Every test starts on a PATH with no npu-smi and without ASCEND_RT_VISIBLE_DEVICES."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"]))
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    return bin_dir


@pytest.fixture
def fake_npu_smi(no_tools: Path, tmp_path: Path) -> FakeNpuSmi:
    """Write ``bin/npu-smi``: a script that prints fixture files the way npu-smi answers.

    ``fake_npu_smi(info="info_910b_alarm.txt", health={5: "health_alarm.txt"},
    ecc={3: "ecc_double_bit.txt"}, info_exit=0, hang=False)``. Every call's arguments are
    appended to ``tmp_path/npu-smi.log``; with ``hang``, ``npu-smi info`` starts a child and
    both wait, writing their pids to ``tmp_path/pids``.
    """

    def make(
        info: str = "info_910b_healthy.txt",
        health: dict[int, str] | None = None,
        ecc: dict[int, str] | None = None,
        default_ecc: str = "ecc_ok.txt",
        temp: str = "temp.txt",
        info_exit: int = 0,
        hang: bool = False,
    ) -> Path:
        def cat(name: str) -> str:
            return f"cat {shlex.quote(str(NPU_SMI / name))}"

        cases = []
        if hang:
            pids = tmp_path / "pids"
            cases.append(
                f'"info") sleep 600 & echo $! >> {pids}; echo $$ >> {pids}; wait; exit 0 ;;'
            )
        else:
            cases.append(f'"info") {cat(info)}; exit {info_exit} ;;')
        for npu, name in (health or {}).items():
            cases.append(f'"info -t health -i {npu} -c "*) {cat(name)} ;;')
        cases.append(f'"info -t health -i "*) {cat("health_ok.txt")} ;;')
        for npu, name in (ecc or {}).items():
            cases.append(f'"info -t ecc -i {npu} -c "*) {cat(name)} ;;')
        cases.append(f'"info -t ecc -i "*) {cat(default_ecc)} ;;')
        cases.append(f'"info -t temp -i "*) {cat(temp)} ;;')
        cases.append('*) echo "Error: invalid command: $*" >&2; exit 2 ;;')
        script = no_tools / "npu-smi"
        script.write_text(
            "#!/bin/bash\n"
            f'echo "$*" >> {shlex.quote(str(tmp_path / "npu-smi.log"))}\n'
            'case "$*" in\n' + "\n".join(f"  {c}" for c in cases) + "\nesac\n"
        )
        script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return script

    return make


@pytest.fixture
def torch_npu(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """``torch_npu("broken")`` puts ``fixtures/torch_npu_broken`` on sys.path and PYTHONPATH."""

    def install(kind: str) -> None:
        path = str(FIXTURES / f"torch_npu_{kind}")
        monkeypatch.syspath_prepend(path)
        monkeypatch.setenv(
            "PYTHONPATH", os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")]))
        )

    return install


def calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "npu-smi.log"
    return log.read_text().splitlines() if log.exists() else []
