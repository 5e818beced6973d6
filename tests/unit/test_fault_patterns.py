"""Fault patterns as a plugin kind: loading, normalisation, ``planaria plugins``, ``match``."""

from __future__ import annotations

import json

import pytest

from planaria.diagnosis.classify import BUILTIN_PATTERNS, Classifier
from planaria.fault_pattern.api import FaultClass, FaultPattern, match
from planaria.health.api import HealthCheck, HealthCheckRecord
from planaria.plugin import hookimpl
from planaria.plugin.manager import PluginManager, PluginStatus

HBM = "fatal: MYCHIP-E42 on hbm3 (stack 2)"


def test_a_plugin_returning_one_pattern_alone_registers_it(plugin_path):
    plugin_path("patterns")
    manager = PluginManager.from_entry_points()
    patterns = [(n, p) for n, p in manager.fault_patterns() if n == "mychip_patterns"]
    assert len(patterns) == 1
    info = manager.plugins["mychip_patterns"]
    assert info.status is PluginStatus.LOADED, info.reason
    assert info.kinds == ["fault_pattern"]
    assert [p.reason for p in info.fault_patterns] == ["MyChip HBM uncorrectable error"]
    verdict = Classifier(plugins=manager.fault_patterns()).classify(1, None, HBM)
    assert (verdict.kind, verdict.source, verdict.line) == (
        FaultClass.NODE,
        "plugin mychip_patterns",
        HBM,
    )


def test_planaria_plugins_lists_fault_patterns_as_a_kind(cli):
    listed = cli("plugins", "--json", plugins=("patterns",))
    assert listed.returncode == 0, listed.stderr
    (info,) = [i for i in json.loads(listed.stdout) if i["name"] == "mychip_patterns"]
    assert info["kinds"] == ["fault_pattern"]
    assert info["records"] == []
    assert info["fault_patterns"] == [
        {"pattern": r"MYCHIP-E42\b", "kind": "node", "reason": "MyChip HBM uncorrectable error"}
    ]
    text = " ".join(cli("plugins", plugins=("patterns",)).stdout.split())
    assert "mychip_patterns │ fault_pattern │ planaria_fixture_patterns 1.0" in text
    assert "1 fault pattern (node): MyChip HBM uncorrectable error" in text


class _Check(HealthCheck):  # type: ignore[type-arg]
    def run(self):  # type: ignore[no-untyped-def]
        return []


def test_a_wrong_record_alone_fails_the_plugin_and_names_its_type():
    class Wrong:
        @hookimpl
        def planaria_health_checks(self):
            return HealthCheckRecord(name="wrongchip", factory=_Check)

        @hookimpl
        def planaria_fault_patterns(self):
            return HealthCheckRecord(name="oops", factory=_Check)

    class Good:
        @hookimpl
        def planaria_fault_patterns(self):
            return FaultPattern(pattern="MYCHIP-E42", kind="node")

    manager = PluginManager()
    wrong = manager.register(Wrong(), "wrong")
    manager.register(Good(), "good")
    assert [(n, p.pattern) for n, p in manager.fault_patterns()] == [("good", "MYCHIP-E42")]
    assert wrong.status is PluginStatus.FAILED
    assert wrong.reason == (
        "planaria_fault_patterns() failed: TypeError: planaria_fault_patterns() must return "
        "FaultPattern records, got HealthCheckRecord"
    )
    assert wrong.records == [] and wrong.kinds == []


def test_match_tests_patterns_on_a_line_as_the_classifier_would():
    mine = FaultPattern(pattern=r"MYCHIP-E(?:17|42)\b", kind="node", reason="HBM error")
    verdict = match(mine, HBM)
    assert verdict is not None
    assert (verdict.kind, verdict.reason, verdict.source, verdict.line) == (
        FaultClass.NODE,
        "HBM error",
        "pattern",
        HBM,
    )
    assert match(mine, "fatal: MYCHIP-E420 on hbm3") is None
    first = FaultPattern(pattern="hbm3", kind="transient")
    assert match([first, mine], HBM).kind is FaultClass.TRANSIENT  # type: ignore[union-attr]
    assert match((p for p in [mine]), "ok") is None


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "node"),
        ("torch.OutOfMemoryError: Tried to allocate 2.00 GiB", "transient"),
        ("MemoryError", "transient"),
        ("[rank3]:[E ProcessGroupNCCL.cpp:616] Watchdog caught collective operation timeout: "
         "WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for 600000 milliseconds", "transient"),
    ],
)  # fmt: skip
def test_the_core_keeps_the_vendor_neutral_patterns(line, kind):
    verdict = match(BUILTIN_PATTERNS, line)
    assert verdict is not None and verdict.kind is FaultClass(kind)


@pytest.mark.parametrize(
    "line",
    [
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=48211, name=python, GPU has fallen off the bus.",
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
        "unhandled system error, NCCL version 2.19.3",
        "RuntimeError: HCCL function error: hcclAllReduce(...), error code is 7",
    ],
)
def test_the_core_knows_no_vendor_message(line):
    assert match(BUILTIN_PATTERNS, line) is None
