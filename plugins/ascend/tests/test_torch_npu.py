"""torch_npu probed in a child process, never imported by the checking process."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import FakeNpuSmi

from planaria.health.api import CheckContext, Status
from planaria_ascend import AscendCheck, AscendOptions
from planaria_ascend.commands import Runner
from planaria_ascend.torch_probe import probe

Install = Callable[[str], None]

LIBHCCL = "ImportError: libhccl.so: cannot open shared object file: No such file or directory"
ADVICE = (
    "set TORCH_DEVICE_BACKEND_AUTOLOAD=0 so that `import torch` works without it, "
    "or install CANN and source its set_env.sh"
)


def test_not_installed() -> None:
    result = probe(Runner(), 30)
    assert not result.installed


def test_broken_torch_npu_is_probed_with_autoload_off(
    torch_npu: Install, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch_npu("broken")
    record = tmp_path / "autoload"
    monkeypatch.setenv("FAKE_TORCH_NPU_RECORD", str(record))
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
    result = probe(Runner(), 30)
    assert result.installed and not result.loaded
    assert result.reason == LIBHCCL
    assert record.read_text() == "0"
    assert "torch_npu" not in sys.modules


def test_broken_torch_npu_without_npu_smi_is_not_applicable(
    torch_npu: Install, context: CheckContext
) -> None:
    torch_npu("broken")
    (result,) = AscendCheck(AscendOptions(), context).run()
    assert result.status is Status.NOT_APPLICABLE
    assert result.detail.startswith("no Ascend driver on this node (npu-smi is not found (PATH=")
    assert result.detail.endswith(f"; torch_npu is installed but cannot load: {LIBHCCL}; {ADVICE}")
    assert "torch_npu" not in sys.modules


def test_broken_torch_npu_with_npus_fails(
    torch_npu: Install, fake_npu_smi: FakeNpuSmi, context: CheckContext
) -> None:
    torch_npu("broken")
    fake_npu_smi()
    results = {r.device: r for r in AscendCheck(AscendOptions(), context).run()}
    assert results["torch_npu"].status is Status.FAILED
    assert results["torch_npu"].detail == (
        f"torch_npu is installed but cannot load: {LIBHCCL}; {ADVICE}"
    )
    assert results["npu0"].status is Status.OK


def test_working_torch_npu_counts_devices(
    torch_npu: Install, fake_npu_smi: FakeNpuSmi, context: CheckContext
) -> None:
    torch_npu("working")
    fake_npu_smi()
    results = {r.device: r for r in AscendCheck(AscendOptions(), context).run()}
    assert results["torch_npu"].status is Status.OK
    assert results["torch_npu"].detail == "torch_npu loads and sees 8 NPU(s)"
    assert "torch_npu" not in sys.modules


def test_torch_npu_sees_fewer_devices(
    torch_npu: Install,
    fake_npu_smi: FakeNpuSmi,
    context: CheckContext,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch_npu("working")
    fake_npu_smi()
    monkeypatch.setenv("FAKE_TORCH_NPU_COUNT", "6")
    results = {r.device: r for r in AscendCheck(AscendOptions(), context).run()}
    assert results["torch_npu"].status is Status.FAILED
    assert results["torch_npu"].detail == "torch_npu sees 6 NPU(s), npu-smi 8"
    # Restricted on purpose: compared with the visible devices instead.
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,1,2,3,4,5")
    results = {r.device: r for r in AscendCheck(AscendOptions(), context).run()}
    assert results["torch_npu"].status is Status.OK


def test_torch_npu_alone(
    torch_npu: Install, context: CheckContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch_npu("working")
    monkeypatch.setenv("FAKE_TORCH_NPU_COUNT", "2")
    results = {r.device: r for r in AscendCheck(AscendOptions(expected_devices=2), context).run()}
    assert results["ascend"].status is Status.OK
    assert results["ascend"].detail == "2 NPU(s) in torch_npu"
    assert results["npu1"].status is Status.OK
    assert results["npu1"].detail.startswith("Ascend910B3 (torch_npu); health not read: npu-smi")


def test_torch_npu_probe_can_be_turned_off(torch_npu: Install, context: CheckContext) -> None:
    torch_npu("working")
    (result,) = AscendCheck(AscendOptions(torch_npu=False), context).run()
    assert result.status is Status.NOT_APPLICABLE
    assert result.detail.endswith(", and torch_npu not probed")


def test_a_hanging_import_times_out(torch_npu: Install, context: CheckContext) -> None:
    torch_npu("hang")
    result = probe(Runner(), 1.0)
    assert result.installed and not result.loaded
    assert result.reason == "importing it did not finish within 1s"
