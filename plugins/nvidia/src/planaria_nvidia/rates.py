"""What the ``nvidia`` node benchmark reports, computed from what it timed. Pure arithmetic, so
that the figures a node is judged by are tested without a GPU.

Rates are decimal (1 GB/s = 1e9 bytes per second, 1 TFLOP/s = 1e12 FLOP per second), as
nvidia-smi, nccl-tests and GPU data sheets give them.
"""

from __future__ import annotations

from collections.abc import Mapping


def gemm_tflops(m: int, n: int, k: int, seconds: float) -> float:
    """TFLOP/s of one ``(m x k) @ (k x n)`` product that took ``seconds``: each of the
    ``m * n`` outputs takes ``k`` multiplications and ``k`` additions."""
    _positive(seconds)
    return 2.0 * m * n * k / seconds / 1e12


def gbps(nbytes: int, seconds: float) -> float:
    """GB/s of a copy of ``nbytes`` that took ``seconds`` (bytes copied, not bytes read plus
    written: a device-to-device copy moves twice that through the GPU's memory)."""
    _positive(seconds)
    return nbytes / seconds / 1e9


def allreduce_busbw(nbytes: int, seconds: float, ranks: int) -> float:
    """Bus bandwidth (GB/s) of an allreduce of ``nbytes`` per rank over ``ranks`` ranks, as
    nccl-tests defines it: the algorithm bandwidth ``nbytes / seconds`` times
    ``2 * (ranks - 1) / ranks``, the share of the data each rank must send and receive in any
    allreduce. It is comparable with the link's own bandwidth whatever the number of ranks."""
    if ranks < 2:
        raise ValueError(f"an allreduce's bus bandwidth needs at least 2 ranks, got {ranks}")
    return gbps(nbytes, seconds) * 2.0 * (ranks - 1) / ranks


def below_minimums(figures: Mapping[str, float], minimums: Mapping[str, float | None]) -> list[str]:
    """``"name 12.3 < minimum 40"`` for each figure under its minimum (``None``: no minimum;
    a figure not measured here is not judged)."""
    found = []
    for name, minimum in minimums.items():
        value = figures.get(name)
        if minimum is not None and value is not None and value < minimum:
            found.append(f"{name} {value:.4g} < minimum {minimum:g}")
    return found


def _positive(seconds: float) -> None:
    if not seconds > 0:
        raise ValueError(f"a timed span must be above 0 seconds, got {seconds!r}")
