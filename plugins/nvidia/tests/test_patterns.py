"""The NVIDIA fault patterns on driver, CUDA and NCCL messages as they appear in worker logs."""

from __future__ import annotations

import pytest

from planaria.diagnosis.classify import Classifier
from planaria.fault_pattern.api import FaultClass, match
from planaria.plugin.manager import PluginManager
from planaria.testing import FaultPatternConformance, assert_classifies
from planaria_nvidia import plugin
from planaria_nvidia.xids import DEFAULT_FATAL

# Kernel-log lines in the format of the 535-570 drivers (``dmesg``, ``journalctl -k``).
XID = {
    13: "NVRM: Xid (PCI:0000:3b:00): 13, pid=48211, name=python, Graphics SM Warp Exception on "
    "(GPC 1, TPC 3, SM 0): Out Of Range Address",
    31: "NVRM: Xid (PCI:0000:b3:00): 31, pid=48211, name=python, Ch 00000010, intr 10000000. "
    "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f3c_12000000. Fault is of type "
    "FAULT_PDE ACCESS_TYPE_VIRT_READ",
    43: "NVRM: Xid (PCI:0000:3b:00): 43, pid=48211, name=python, Ch 00000010",
    45: "NVRM: Xid (PCI:0000:3b:00): 45, pid=48211, name=python, Ch 00000010",
    48: "NVRM: Xid (PCI:0000:04:00): 48, pid=48211, name=python, An uncorrectable double bit "
    "error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.",
    79: "NVRM: Xid (PCI:0000:3b:00): 79, pid=48211, name=python, GPU has fallen off the bus.",
    92: "NVRM: Xid (PCI:0000:3b:00): 92, pid=48211, name=python, High single-bit ECC error rate",
    94: "NVRM: Xid (PCI:0000:ca:00): 94, pid=48211, name=python, Contained: SM (0x1). "
    "RST: No, D-RST: No",
    119: "NVRM: Xid (PCI:0000:1b:00): 119, pid=48211, name=python, Timeout after 6s of waiting "
    "for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20800a4c 0x4).",
}

TRACEBACK = """\
Traceback (most recent call last):
  File "/job/train.py", line 10, in <module>
    loss = model(batch)
RuntimeError: CUDA error: an illegal memory access was encountered
CUDA kernel errors might be asynchronously reported at some other API call.
"""


def patterns():  # type: ignore[no-untyped-def]
    return plugin.planaria_fault_patterns()


@pytest.mark.parametrize(
    ("xid", "kind"),
    [(13, "user"), (31, "user"), (43, "user"), (45, "transient"), (48, "node"), (79, "node"),
     (92, "transient"), (94, "node"), (119, "node")],
)  # fmt: skip
def test_an_xid_is_a_node_fault_only_when_it_is_a_hardware_one(xid, kind):
    verdict = match(patterns(), XID[xid])
    assert verdict is not None
    assert verdict.kind is FaultClass(kind), verdict.reason
    named = f"XID {xid}" if xid != 92 else "Xid error, neither a hardware nor an application"
    assert named in verdict.reason
    assert verdict.line == XID[xid]


def test_every_default_fatal_xid_is_a_node_fault_in_every_spelling():
    for xid in DEFAULT_FATAL:
        for line in (f"NVRM: Xid (PCI:0000:3b:00): {xid}, pid=1, name=python", f"Xid {xid}"):
            verdict = match(patterns(), line)
            assert verdict is not None and verdict.kind is FaultClass.NODE, line
    # Another number that starts like a fatal one is not that one.
    other = match(patterns(), "NVRM: Xid (PCI:0000:3b:00): 790, pid=1, name=python")
    assert other is not None and other.kind is FaultClass.TRANSIENT


def test_the_driver_verdict_outranks_the_cuda_error_beside_it():
    """An illegal memory access alone reads as a failing GPU; with an Xid 31 (a page fault of
    the program) it is the program's; with an Xid 79 the GPU's."""
    alone = match(patterns(), TRACEBACK)
    assert alone is not None and alone.kind is FaultClass.NODE
    assert alone.reason == "CUDA illegal memory access (often a failing GPU)"
    program = match(patterns(), TRACEBACK + XID[31] + "\n")
    assert program is not None and program.kind is FaultClass.USER
    gpu = match(patterns(), XID[13] + "\n" + XID[79] + "\n" + TRACEBACK)
    assert gpu is not None and gpu.kind is FaultClass.NODE and gpu.line == XID[79]


@pytest.mark.parametrize(
    ("line", "kind", "reason"),
    [
        ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "node", "ECC"),
        ("RuntimeError: CUDA error: unspecified launch failure", "node", "launch failure"),
        ("RuntimeError: No CUDA GPUs are available; no CUDA-capable device is detected", "node",
         "GPU unavailable"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
         "total capacity of 79.11 GiB of which 1.12 GiB is free.", "transient", "out of memory"),
        ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
         "unhandled system error, NCCL version 2.19.3", "transient", "NCCL"),
        ("node-3:48211:48390 [1] NCCL WARN NET/IB : Got completion from peer 10.0.0.7<52033> "
         "with status=12 opcode=0 len=0 vendor err 129 (Recv)", "transient", "NCCL"),
    ],
)  # fmt: skip
def test_cuda_and_nccl_messages(line, kind, reason):
    assert_classifies(patterns(), line, kind, reason)


def test_the_installed_plugin_classifies_ahead_of_the_core():
    manager = PluginManager.from_entry_points()
    info = manager.plugins["nvidia"]
    registered = [p for name, p in manager.fault_patterns() if name == "nvidia"]
    assert registered == list(patterns())
    assert info.kinds == ["fault_pattern", "health_check", "node_benchmark"]
    verdict = Classifier(plugins=manager.fault_patterns()).classify(1, None, TRACEBACK + XID[13])
    assert (verdict.kind, verdict.source) == (FaultClass.USER, "plugin nvidia")


class TestNvidiaPatterns(FaultPatternConformance):
    """Every pattern on a recorded line; none on a healthy GPU job's log."""

    plugin_name = "nvidia"
    samples = [
        *((f"NVRM: Xid (PCI:0000:3b:00): {xid}, pid=48211, name=python", "node")
          for xid in DEFAULT_FATAL),
        (XID[13], "user"), (XID[31], "user"), (XID[43], "user"), (XID[45], "transient"),
        (XID[92], "transient"),
        ("NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.", "node"),
        ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "node"),
        ("RuntimeError: CUDA error: an illegal instruction was encountered", "node"),
        ("RuntimeError: CUDA error: uncorrectable NVLink error detected during the execution",
         "node"),
        ("RuntimeError: CUDA error: CUDA-capable device(s) is/are busy or unavailable", "node"),
        ("NVLink fatal error on link 4 of GPU 3", "node"),
        ("RuntimeError: CUDA error: an illegal memory access was encountered", "node"),
        ("RuntimeError: CUDA error: unspecified launch failure", "node"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", "transient"),
        ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
         "unhandled system error, NCCL version 2.19.3", "transient"),
    ]  # fmt: skip
    ordinary_lines = [
        "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5a3c1f0e-1c2b-4e55-9d1e-0123456789ab)",
        "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7",
        "node-3:48211:48390 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read",
        "node-3:48211:48390 [0] NCCL INFO Connected all rings",
        "node-3:48211:48390 [0] NCCL INFO NCCL_IB_TIMEOUT set by environment to 22.",
    ]
