"""The ``nvidia`` node benchmark: its figures' arithmetic, its options, the conformance suite
(on a machine without a GPU, by its not-applicable path) and, marked ``gpu``, a real run."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from planaria.testing.node_benchmark import NodeBenchmarkConformance, run_group
from planaria_nvidia.benchmark import NvidiaBenchmarkOptions, driver_gpus
from planaria_nvidia.rates import allreduce_busbw, below_minimums, gbps, gemm_tflops


def cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def test_gemm_tflops_counts_a_multiply_and_an_add_per_term() -> None:
    # 8192^3 products, each a multiply and an add, in 1.1 ms: ~1000 TFLOP/s (an H200's bf16).
    assert gemm_tflops(8192, 8192, 8192, 1.1e-3) == pytest.approx(999.5, rel=1e-3)
    assert gemm_tflops(2, 3, 4, 1e-12) == pytest.approx(48.0)


def test_copy_rate_is_decimal_gigabytes_per_second() -> None:
    assert gbps(4 << 30, 0.078) == pytest.approx(55.06, rel=1e-3)
    with pytest.raises(ValueError, match="above 0 seconds"):
        gbps(1, 0.0)


def test_busbw_is_nccl_tests_algbw_times_2_n_minus_1_over_n() -> None:
    # 1 GB in 10 ms is an algorithm bandwidth of 100 GB/s; on 8 GPUs the bus carries 7/4 of it.
    assert allreduce_busbw(10**9, 0.01, 8) == pytest.approx(175.0)
    assert allreduce_busbw(10**9, 0.01, 2) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        allreduce_busbw(10**9, 0.01, 1)


def test_minimums_name_each_figure_below_its_own() -> None:
    figures = {"gemm_tflops": 500.0, "host_to_device_gbps": 12.5, "device_copy_gbps": 3000.0}
    minimums = {
        "gemm_tflops": 400.0,
        "host_to_device_gbps": 40.0,
        "device_copy_gbps": None,
        "allreduce_busbw_gbps": 100.0,  # not measured here (one GPU): not judged
    }
    assert below_minimums(figures, minimums) == ["host_to_device_gbps 12.5 < minimum 40"]


def test_options_take_byte_sizes_and_reject_nonsense() -> None:
    options = NvidiaBenchmarkOptions(copy_bytes="256MiB", min_gemm_tflops=400)
    assert options.copy_bytes == 256 << 20
    assert options.minimums()["gemm_tflops"] == 400
    with pytest.raises(ValidationError, match="min_host_to_device_gbps"):
        NvidiaBenchmarkOptions(min_host_to_device_gbps=0)
    with pytest.raises(ValidationError, match="copy_bytes"):
        NvidiaBenchmarkOptions(copy_bytes="1KiB")


@pytest.mark.skipif(cuda() or driver_gpus() > 0, reason="this machine has an NVIDIA GPU")
def test_without_a_gpu_it_says_not_applicable_and_runs_the_cpu_benchmark() -> None:
    (result,) = run_group("nvidia", {}, 60.0, 1)
    assert result.status == "ok", result.error
    assert str(result.info["nvidia"]).startswith("not applicable here: no NVIDIA GPU")
    assert set(result.measures) == {"matmul"}


class TestNvidiaBenchmark(NodeBenchmarkConformance):
    benchmark_name = "nvidia"

    @pytest.fixture
    def benchmark_options(self) -> dict[str, object]:
        return {"gemm_size": 2048, "copy_bytes": "64MiB", "host_copy_bytes": "64MiB"}


@pytest.mark.gpu
@pytest.mark.skipif(not cuda(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_on_a_gpu_every_figure_is_measured() -> None:
    import torch

    count = torch.cuda.device_count()
    (result,) = run_group("nvidia", {"repeats": 3}, 120.0, 1)
    assert result.status == "ok", result.error
    expected = {"gemm", "device_copy", "host_to_device", "device_to_host"}
    assert set(result.measures) == expected | ({"allreduce"} if count > 1 else set())
    assert all(math.isfinite(v) and v > 0 for v in result.measures.values())
    assert result.info["gpus"] == count
    # Anything faster than these is a timing bug, not a GPU.
    assert 1 < float(result.info["gemm_tflops"]) < 10_000
    assert 1 < float(result.info["host_to_device_gbps"]) < 1_000
    if count == 1:
        assert str(result.info["allreduce"]).startswith("skipped: one GPU")
    else:
        assert float(result.info["allreduce_busbw_gbps"]) > 1
