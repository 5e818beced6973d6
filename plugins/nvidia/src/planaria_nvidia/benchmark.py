"""The ``nvidia`` node benchmark: what makes one GPU node slower than its peers.

On every GPU of the node: a bf16 GEMM (the tensor cores), a device-to-device copy (HBM), and
copies between pinned host memory and the device both ways (the PCIe link: one trained at a
lower width or generation is a classic slow node). Across the node's GPUs: an NCCL allreduce
(NVLink or PCIe peer links), judged by its bus bandwidth as nccl-tests defines it; skipped
with one GPU. Every span is timed with CUDA events on the device, so the host's load does not
count. The node's group (the pre-flight pairs it with its peers) is joined with gloo first, as
the core's ``cpu`` benchmark does: a node that cannot reach its peers fails there.

Measures are the slowest GPU's seconds per operation, judged against the other nodes' median;
``info`` carries every GPU's TFLOP/s and GB/s. Options may also set absolute minimums: a node
below one fails, whatever its peers measured (a whole cluster can be slow).

A node without an NVIDIA driver is not this benchmark's to judge: it runs the core's ``cpu``
benchmark in its place and says so (``info.nvidia``). A node whose driver answers but where
torch cannot use CUDA fails: that is a broken GPU stack, not a CPU node.
"""

from __future__ import annotations

import datetime
import os
import statistics
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ByteSize, ConfigDict, Field

from planaria.chaos import burn
from planaria.node_benchmark.api import (
    BenchmarkContext,
    BenchmarkResult,
    NodeBenchmark,
)
from planaria.node_benchmark.cpu import CpuBenchmark, CpuOptions
from planaria_nvidia.rates import allreduce_busbw, below_minimums, gbps, gemm_tflops


class NvidiaBenchmarkOptions(BaseModel):
    """Sizes of the timed operations, and optional absolute minimums (unset: not checked)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gemm_size: int = Field(default=8192, ge=64, le=65536, description="bf16 GEMM m = n = k")
    copy_bytes: ByteSize = Field(
        default=ByteSize(1 << 30), ge=1 << 20, description="bytes per device-to-device copy"
    )
    host_copy_bytes: ByteSize = Field(
        default=ByteSize(1 << 30), ge=1 << 20, description="bytes per host<->device copy"
    )
    allreduce_bytes: ByteSize = Field(
        default=ByteSize(256 << 20), ge=1 << 20, description="bytes per GPU per allreduce"
    )
    repeats: int = Field(default=5, ge=3, description="timed repetitions; the median counts")
    min_gemm_tflops: float | None = Field(default=None, gt=0, description="per GPU")
    min_device_copy_gbps: float | None = Field(default=None, gt=0, description="per GPU")
    min_host_to_device_gbps: float | None = Field(default=None, gt=0, description="per GPU")
    min_device_to_host_gbps: float | None = Field(default=None, gt=0, description="per GPU")
    min_allreduce_busbw_gbps: float | None = Field(
        default=None, gt=0, description="NCCL allreduce bus bandwidth over the node's GPUs"
    )
    cpu: CpuOptions = Field(
        default_factory=CpuOptions, description="the cpu benchmark run on a node without GPUs"
    )

    def minimums(self) -> dict[str, float | None]:
        return {
            "gemm_tflops": self.min_gemm_tflops,
            "device_copy_gbps": self.min_device_copy_gbps,
            "host_to_device_gbps": self.min_host_to_device_gbps,
            "device_to_host_gbps": self.min_device_to_host_gbps,
            "allreduce_busbw_gbps": self.min_allreduce_busbw_gbps,
        }


def driver_gpus() -> int:
    """GPUs the NVIDIA driver reports (NVML); 0 without a driver."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


class NvidiaBenchmark(NodeBenchmark[NvidiaBenchmarkOptions]):
    name = "nvidia"

    def run(self, context: BenchmarkContext) -> BenchmarkResult:
        import torch

        if not torch.cuda.is_available():
            gpus = driver_gpus()
            if gpus:
                raise RuntimeError(
                    f"the NVIDIA driver reports {gpus} GPU(s) but torch cannot use CUDA "
                    f"(torch {torch.__version__}, CUDA build {torch.version.cuda}): "
                    "check CUDA_VISIBLE_DEVICES, the driver and torch's CUDA build"
                )
            return self.not_applicable(context, "no NVIDIA GPU on this node")
        with group(context):
            return self.measure(context)

    def not_applicable(self, context: BenchmarkContext, why: str) -> BenchmarkResult:
        """The core's ``cpu`` benchmark, so that the node is still compared with its peers."""
        result = CpuBenchmark(self.options.cpu).run(context)
        info = {**result.info, "nvidia": f"not applicable here: {why}; ran the cpu benchmark"}
        return BenchmarkResult(measures=result.measures, info=info)

    def measure(self, context: BenchmarkContext) -> BenchmarkResult:
        import torch

        options = self.options
        count = torch.cuda.device_count()
        per_gpu = [self.time_gpu(index, context) for index in range(count)]
        measures: dict[str, float] = {}
        info: dict[str, float | int | str] = {"gpus": count, "gpu_name": gpu_name(0)}
        figures: dict[str, float] = {}
        for name, rate in (
            ("gemm", "gemm_tflops"),
            ("device_copy", "device_copy_gbps"),
            ("host_to_device", "host_to_device_gbps"),
            ("device_to_host", "device_to_host_gbps"),
        ):
            measures[name] = max(gpu[name] for gpu in per_gpu)
            figures[rate] = min(gpu[rate] for gpu in per_gpu)
            info[rate] = round(figures[rate], 3)
            for index, gpu in enumerate(per_gpu):
                info[f"gpu{index}_{rate}"] = round(gpu[rate], 3)
        if count < 2:
            info["allreduce"] = "skipped: one GPU on this node, no peer to reduce with"
        else:
            seconds = slowed(context, self.time_allreduce(count))
            measures["allreduce"] = seconds
            figures["allreduce_busbw_gbps"] = allreduce_busbw(
                options.allreduce_bytes, seconds, count
            )
            info["allreduce_busbw_gbps"] = round(figures["allreduce_busbw_gbps"], 3)
        low = below_minimums(figures, options.minimums())
        if low:
            raise RuntimeError(f"below the configured minimums: {'; '.join(low)}")
        return BenchmarkResult(measures=measures, info=info)

    def time_gpu(self, index: int, context: BenchmarkContext) -> dict[str, float]:
        """Seconds per operation (after ``slow_node`` injection) and the rates, on GPU
        ``index``; each operation's buffers are freed before the next one's are allocated."""
        import torch

        options = self.options
        found: dict[str, float] = {}
        with torch.cuda.device(index):
            found["gemm"] = slowed(context, time_gemm(options.gemm_size, options.repeats))
            found["device_copy"] = slowed(context, time_device_copy(options))
            to_device, to_host = time_host_copies(options)
            found["host_to_device"] = slowed(context, to_device)
            found["device_to_host"] = slowed(context, to_host)
            torch.cuda.empty_cache()
        size = options.gemm_size
        found["gemm_tflops"] = gemm_tflops(size, size, size, found["gemm"])
        found["device_copy_gbps"] = gbps(options.copy_bytes, found["device_copy"])
        found["host_to_device_gbps"] = gbps(options.host_copy_bytes, found["host_to_device"])
        found["device_to_host_gbps"] = gbps(options.host_copy_bytes, found["device_to_host"])
        return found

    def time_allreduce(self, count: int) -> float:
        """Seconds of one NCCL allreduce of ``allreduce_bytes`` on each of the node's GPUs
        (one process drives them all: ``torch.cuda.nccl``), the slowest GPU's events."""
        import torch
        import torch.cuda.nccl as nccl

        probes = [torch.empty(1, device=f"cuda:{i}") for i in range(count)]
        if not nccl.is_available(probes):  # type: ignore[no-untyped-call]
            raise RuntimeError("torch was built without NCCL: the GPUs' allreduce cannot run")
        numel = self.options.allreduce_bytes // 4
        tensors = [torch.ones(numel, device=f"cuda:{i}") for i in range(count)]
        nccl.all_reduce(tensors)  # type: ignore[no-untyped-call]  # warm-up: communicators
        for tensor in tensors:
            tensor.fill_(1.0)
        nccl.all_reduce(tensors)  # type: ignore[no-untyped-call]
        for index, tensor in enumerate(tensors):
            if not bool(torch.all(tensor == float(count))):
                raise RuntimeError(
                    f"NCCL allreduce gave wrong sums on GPU {index}: expected {count} everywhere"
                )
        times = []
        for _ in range(self.options.repeats):
            starts, ends = [], []
            for index in range(count):
                with torch.cuda.device(index):
                    starts.append(timing_event())
                    ends.append(timing_event())
                    starts[-1].record()
            nccl.all_reduce(tensors)  # type: ignore[no-untyped-call]
            for index in range(count):
                with torch.cuda.device(index):
                    ends[index].record()
            for end in ends:
                end.synchronize()
            times.append(max(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) / 1e3)
        return float(statistics.median(times))


def time_gemm(size: int, repeats: int) -> float:
    """One ``size``-cubed bf16 GEMM on the current device, in seconds."""
    import torch

    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(size, size, device="cuda", dtype=torch.bfloat16)
    return cuda_timed(lambda: torch.mm(a, b, out=out), repeats)


def time_device_copy(options: NvidiaBenchmarkOptions) -> float:
    """One device-to-device copy of ``copy_bytes`` on the current device, in seconds."""
    import torch

    src = torch.empty(options.copy_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return cuda_timed(lambda: dst.copy_(src), options.repeats)


def time_host_copies(options: NvidiaBenchmarkOptions) -> tuple[float, float]:
    """Seconds of one copy of ``host_copy_bytes`` from pinned host memory to the current device,
    and of one back."""
    import torch

    on_device = torch.empty(options.host_copy_bytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(options.host_copy_bytes, dtype=torch.uint8, pin_memory=True)
    to_device = cuda_timed(lambda: on_device.copy_(pinned, non_blocking=True), options.repeats)
    to_host = cuda_timed(lambda: pinned.copy_(on_device, non_blocking=True), options.repeats)
    return to_device, to_host


def timing_event() -> Any:
    import torch

    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def cuda_timed(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """The median over ``repeats`` of ``fn()``'s time on the current CUDA stream (events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = timing_event()
        end = timing_event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(statistics.median(times))


def slowed(context: BenchmarkContext, seconds: float) -> float:
    """``seconds`` as a ``slow_node`` fault makes them: the CPU burns the extra time, as
    :meth:`BenchmarkContext.timed` does for a benchmark timed on the host."""
    if context.slow_factor <= 1.0:
        return seconds
    extra = (context.slow_factor - 1.0) * seconds
    burn(extra)
    return seconds + extra


def gpu_name(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_name(index))


class group:
    """The node's pre-flight group, joined over gloo for the benchmark's life: every member
    checks that it reaches its peers (one small allreduce) before timing its GPUs."""

    def __init__(self, context: BenchmarkContext) -> None:
        self.context = context

    def __enter__(self) -> group:
        import torch
        import torch.distributed as dist

        context = self.context
        os.environ.update(
            MASTER_ADDR=context.master_addr,
            MASTER_PORT=str(context.master_port),
            RANK=str(context.rank),
            WORLD_SIZE=str(context.world_size),
        )
        dist.init_process_group(
            "gloo",
            rank=context.rank,
            world_size=context.world_size,
            timeout=datetime.timedelta(seconds=max(1.0, context.timeout)),
        )
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        if tensor.item() != context.world_size:
            dist.destroy_process_group()
            raise RuntimeError(
                f"the group's allreduce gave {tensor.item():g}, expected {context.world_size}"
            )
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()
