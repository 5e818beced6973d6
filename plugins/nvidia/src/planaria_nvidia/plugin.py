"""Registers the ``nvidia`` health check, the ``nvidia`` node benchmark and the NVIDIA fault
patterns (driver Xids, CUDA and NCCL errors) through the ``planaria`` entry-point group."""

from __future__ import annotations

from collections.abc import Iterator

from planaria.plugin import FaultPattern, HealthCheckRecord, NodeBenchmarkRecord, hookimpl
from planaria_nvidia.benchmark import NvidiaBenchmark, NvidiaBenchmarkOptions
from planaria_nvidia.check import NvidiaCheck
from planaria_nvidia.options import NvidiaOptions
from planaria_nvidia.patterns import PATTERNS


@hookimpl
def planaria_health_checks() -> Iterator[HealthCheckRecord]:
    yield HealthCheckRecord(
        name="nvidia",
        factory=NvidiaCheck,
        options=NvidiaOptions,
        summary="NVIDIA GPUs through NVML: count, ECC, row remapping, XID events, throttling, "
        "temperature, NVLink errors",
    )


@hookimpl
def planaria_node_benchmarks() -> Iterator[NodeBenchmarkRecord]:
    yield NodeBenchmarkRecord(
        name="nvidia",
        factory=NvidiaBenchmark,
        options=NvidiaBenchmarkOptions,
        summary="per GPU a bf16 GEMM, device and pinned host copies; an NCCL allreduce over "
        "the node's GPUs (CUDA events)",
    )


@hookimpl
def planaria_fault_patterns() -> list[FaultPattern]:
    return list(PATTERNS)
