"""The built-in ``cpu`` node benchmark: a torch matmul and a gloo allreduce.

The matmul is timed in CPU time on one thread: nodes that share a machine (the local scheduler,
an oversubscribed host) do not look slow because of one another's load, while a slower or
throttled processor still takes longer. The allreduce proves that the node forms a group and
moves data with its peers; its wall time is reported but not judged, because on a CPU its wall
time says more about the machine's load than about the node. A vendor benchmark whose
collective time does tell a slow link (NCCL's, HCCL's bus bandwidth) puts it in ``measures``.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

from planaria.node_benchmark.api import (
    BenchmarkContext,
    BenchmarkResult,
    NodeBenchmark,
    NodeBenchmarkRecord,
)
from planaria.plugin import hookimpl


class CpuOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    size: int = Field(default=256, ge=16, le=8192, description="matmul of two size x size")
    matmuls: int = Field(default=4, ge=1, description="matmuls per timed repetition")
    repeats: int = Field(default=5, ge=3, description="timed repetitions; the median counts")
    allreduce_numel: int = Field(default=1 << 16, ge=1, description="float32 elements")
    threads: int = Field(default=1, ge=1, description="torch intra-op threads")


class CpuBenchmark(NodeBenchmark[CpuOptions]):
    name = "cpu"

    def run(self, context: BenchmarkContext) -> BenchmarkResult:
        import torch
        import torch.distributed as dist

        options = self.options
        torch.set_num_threads(options.threads)
        generator = torch.Generator().manual_seed(0)
        a = torch.rand(options.size, options.size, generator=generator)
        b = torch.rand(options.size, options.size, generator=generator)

        def matmuls() -> None:
            for _ in range(options.matmuls):
                torch.mm(a, b)

        os.environ.update(
            MASTER_ADDR=context.master_addr,
            MASTER_PORT=str(context.master_port),
            RANK=str(context.rank),
            WORLD_SIZE=str(context.world_size),
        )
        started = time.perf_counter()
        dist.init_process_group(
            "gloo",
            rank=context.rank,
            world_size=context.world_size,
            timeout=datetime.timedelta(seconds=max(1.0, context.timeout)),
        )
        try:
            joined = time.perf_counter() - started
            matmul = context.timed(matmuls, options.repeats, clock="thread")
            tensor = torch.ones(options.allreduce_numel)

            def allreduce() -> None:
                dist.all_reduce(tensor)

            allreduce_s = context.timed(allreduce, options.repeats, clock="wall")
            # Every element is world_size ** (warm-up + repeats) after the repeated sums.
            expected = float(context.world_size ** (options.repeats + 1))
            if not torch.all(tensor == expected):
                raise RuntimeError(
                    f"allreduce gave wrong sums: expected {expected:g} everywhere, "
                    f"got values from {tensor.min().item():g} to {tensor.max().item():g}"
                )
        finally:
            dist.destroy_process_group()
        flops = 2.0 * options.size**3 * options.matmuls
        return BenchmarkResult(
            measures={"matmul": matmul},
            info={
                "matmul_gflops": round(flops / matmul / 1e9, 3) if matmul > 0 else 0.0,
                "allreduce_s": allreduce_s,
                "group_init_s": joined,
            },
        )


@hookimpl
def planaria_node_benchmarks() -> Iterable[NodeBenchmarkRecord]:
    yield NodeBenchmarkRecord(
        name="cpu",
        factory=CpuBenchmark,
        options=CpuOptions,
        summary="torch matmul (CPU time, one thread) and a gloo allreduce",
    )
